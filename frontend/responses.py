"""OpenAI response bodies and stream chunks for the completions and chat endpoints.

A request has one or more choices (n samples of each prompt); every stream chunk carries
one choice, named by its index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from frontend.generation import Delta, TokenLogprob, Usage
from frontend.logprobs_format import ChatLogprobs, CompletionLogprobs
from frontend.tool_parsers import Parser, make_parser, parse_reply


def stream_chunk(response: CompletionFormat | ChatFormat, object_name: str,
                 choices: list[dict[str, Any]]) -> dict[str, Any]:
    chunk = {
        "id": response.request_id,
        "object": object_name,
        "created": response.created,
        "model": response.model,
        "choices": choices,
    }
    if response.include_usage:
        chunk["usage"] = None
    return chunk


@dataclass(slots=True)
class CompletionFormat:
    request_id: str
    model: str
    created: int
    include_usage: bool = False  # streams only: a `usage` key in every chunk, a last one set
    logprobs: CompletionLogprobs | None = None
    echo: list[str] | None = None  # per choice index: the prompt text to put first

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return stream_chunk(self, "text_completion", choices)

    def delta_chunk(self, index: int, delta: Delta, first: bool) -> dict[str, Any]:
        """The echoed prompt, if asked for, rides on the choice's first chunk."""
        return self._chunk([self._choice(index, self._echoed(index, delta) if first else delta)])

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._chunk([]) | {"usage": usage.to_dict()}

    def body(self, results: list[Delta], usage: Usage) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                self._choice(index, self._echoed(index, result))
                for index, result in enumerate(results)
            ],
            "usage": usage.to_dict(),
        }

    def _echoed(self, index: int, delta: Delta) -> Delta:
        if self.echo is None:
            return delta
        return Delta(self.echo[index] + delta.text, delta.finish_reason, delta.logprobs,
                     native_finish_reason=delta.native_finish_reason)

    def _choice(self, index: int, delta: Delta) -> dict[str, Any]:
        return with_native_reason({
            "index": index,
            "text": delta.text,
            "logprobs": None if self.logprobs is None else self.logprobs.format(delta.logprobs),
            "finish_reason": delta.finish_reason,
        }, delta)


@dataclass(slots=True)
class ChatFormat:
    request_id: str
    model: str
    created: int
    include_usage: bool = False
    logprobs: ChatLogprobs | None = None
    tool_parser: str | None = None  # set when the reply may hold tool calls to read out
    _parsers: dict[int, Parser] = field(default_factory=dict)  # per choice, when streaming
    _held_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return stream_chunk(self, "chat.completion.chunk", choices)

    def delta_chunk(self, index: int, delta: Delta, first: bool) -> dict[str, Any] | None:
        """A choice's role rides on its first chunk, with its first token: a client that
        times the first chunk (as `vllm bench serve` does) then measures the real TTFT.
        None when the delta carries nothing to send (text a tool parser holds back)."""
        if self.tool_parser is not None:
            return self._tool_delta_chunk(index, delta, first)
        return self._chunk([self._choice(index, "delta", _delta_message(delta.text, first),
                                         delta)])

    def _tool_delta_chunk(self, index: int, delta: Delta, first: bool) -> dict[str, Any] | None:
        """Content and tool-call deltas as the parser releases them; the logprobs of tokens
        held back ride on the next chunk sent."""
        assert self.tool_parser is not None
        parser = self._parsers.get(index)
        if parser is None:  # not setdefault: that would make a parser for every token
            parser = self._parsers[index] = make_parser(self.tool_parser)
        piece = parser.feed(delta.text)
        finish_reason = delta.finish_reason
        if finish_reason is not None:
            piece.extend(parser.finish(cut_short=finish_reason == "length"))
            if finish_reason == "stop" and parser.num_calls:
                finish_reason = "tool_calls"
        logprobs = self._held_logprobs.pop(index, []) + delta.logprobs
        if not piece.content and not piece.deltas and finish_reason is None:
            self._held_logprobs[index] = logprobs
            return None
        message = _delta_message(piece.content, first)
        if piece.deltas:
            message["tool_calls"] = [call_delta.to_openai() for call_delta in piece.deltas]
        shown = Delta(delta.text, finish_reason, logprobs,
                      native_finish_reason=delta.native_finish_reason)
        return self._chunk([self._choice(index, "delta", message, shown)])

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._chunk([]) | {"usage": usage.to_dict()}

    def body(self, results: list[Delta], usage: Usage) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [self._message_choice(index, result)
                        for index, result in enumerate(results)],
            "usage": usage.to_dict(),
        }

    def _message_choice(self, index: int, result: Delta) -> dict[str, Any]:
        if self.tool_parser is None:
            return self._choice(index, "message", _assistant(result.text), result)
        piece = parse_reply(self.tool_parser, result.text, result.finish_reason == "length")
        if not piece.calls:
            return self._choice(index, "message", _assistant(piece.content), result)
        message = {"role": "assistant", "content": piece.content or None,
                   "tool_calls": [call.to_openai() for call in piece.calls]}
        finish_reason = "tool_calls" if result.finish_reason == "stop" else result.finish_reason
        return self._choice(index, "message", message,
                            Delta(result.text, finish_reason, result.logprobs,
                                  native_finish_reason=result.native_finish_reason))

    def _choice(
        self, index: int, key: str, message: dict[str, Any], delta: Delta
    ) -> dict[str, Any]:
        return with_native_reason({
            "index": index,
            key: message,
            "logprobs": None if self.logprobs is None else self.logprobs.format(delta.logprobs),
            "finish_reason": delta.finish_reason,
        }, delta)


def with_native_reason(choice: dict[str, Any], delta: Delta) -> dict[str, Any]:
    """OpenRouter's `native_finish_reason` beside OpenAI's `finish_reason`, where they differ
    (a deadline: "timeout" beside "length")."""
    if delta.native_finish_reason is not None:
        choice["native_finish_reason"] = delta.native_finish_reason
    return choice


def _assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def _delta_message(text: str, first: bool) -> dict[str, Any]:
    """A choice's first delta carries the role; later ones only text, if any."""
    if first:
        return _assistant(text)
    return {"content": text} if text else {}


ResponseFormat = CompletionFormat | ChatFormat
