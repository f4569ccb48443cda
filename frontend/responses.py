"""OpenAI response bodies and stream chunks for the completions and chat endpoints.

A request has one or more choices (n samples of each prompt); every stream chunk carries
one choice, named by its index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from frontend.generation import Delta, Usage
from frontend.logprobs_format import ChatLogprobs, CompletionLogprobs


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
        return Delta(self.echo[index] + delta.text, delta.finish_reason, delta.logprobs)

    def _choice(self, index: int, delta: Delta) -> dict[str, Any]:
        return {
            "index": index,
            "text": delta.text,
            "logprobs": None if self.logprobs is None else self.logprobs.format(delta.logprobs),
            "finish_reason": delta.finish_reason,
        }


@dataclass(slots=True)
class ChatFormat:
    request_id: str
    model: str
    created: int
    include_usage: bool = False
    logprobs: ChatLogprobs | None = None

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return stream_chunk(self, "chat.completion.chunk", choices)

    def delta_chunk(self, index: int, delta: Delta, first: bool) -> dict[str, Any]:
        """A choice's role rides on its first chunk, with its first token: a client that
        times the first chunk (as `vllm bench serve` does) then measures the real TTFT."""
        if first:
            return self._chunk([self._choice(index, "delta", _assistant(delta.text), delta)])
        message = {"content": delta.text} if delta.text else {}
        return self._chunk([self._choice(index, "delta", message, delta)])

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._chunk([]) | {"usage": usage.to_dict()}

    def body(self, results: list[Delta], usage: Usage) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                self._choice(index, "message", _assistant(result.text), result)
                for index, result in enumerate(results)
            ],
            "usage": usage.to_dict(),
        }

    def _choice(
        self, index: int, key: str, message: dict[str, Any], delta: Delta
    ) -> dict[str, Any]:
        return {
            "index": index,
            key: message,
            "logprobs": None if self.logprobs is None else self.logprobs.format(delta.logprobs),
            "finish_reason": delta.finish_reason,
        }


def _assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


ResponseFormat = CompletionFormat | ChatFormat
