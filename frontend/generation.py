"""One request's run: engine outputs → detokenized text deltas, stop strings applied.

Leaving the `async with` before the engine finished the request (stop string, client
gone, error) ABORTs it in the engine.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from common.protocol import AddRequest, FinishReason, RequestOutput
from frontend.detokenizer import IncrementalDetokenizer
from frontend.engine_client import EngineClient
from frontend.request_metrics import ERROR, RequestTimer
from frontend.request_stream import EngineRequestError, EngineUnavailableError, RequestStream
from frontend.stop_strings import StopStringMatcher


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the model's most likely tokens, best first
    text_offset: int  # where the token's text starts in the choice's output text


@dataclass(slots=True)
class Delta:
    text: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # empty unless requested
    stop_sequence: str | None = None  # the stop string that ended it, if one did
    # Why it ended in the engine's words, where finish_reason had to say it in OpenAI's:
    # "timeout" (its deadline passed; finish_reason "length")
    native_finish_reason: str | None = None


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True, slots=True)
class GenerationHooks:
    """Who follows a generation: sent to the engine, first output back (or its end, whichever
    comes first: called once), tokens generated."""

    sent: Callable[[AddRequest], None] | None = None
    started: Callable[[str], None] | None = None
    generated: Callable[[int], None] | None = None


class Generation:
    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Any,
        request: AddRequest,
        stop: list[str],
        eos_token_ids: list[int],
        arrival: float | None = None,  # time.monotonic() of the API request
        hooks: GenerationHooks | None = None,
    ) -> None:
        self._hooks = hooks or GenerationHooks()
        self._engine = engine
        self._timer = RequestTimer(engine.metrics, len(request.prompt_token_ids),
                                   arrival or time.monotonic())
        self._request = request
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stop_strings = StopStringMatcher(stop)
        sampling = request.sampling
        # A finishing stop token counts as generated but is not part of the text (nor of
        # the logprobs, which describe the text's tokens).
        self._stop_token_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            self._stop_token_ids.update(eos_token_ids)
        self._wants_logprobs = sampling.logprobs is not None
        self._text_length = 0  # characters detokenized so far
        self.usage = Usage(prompt_tokens=len(request.prompt_token_ids))
        self.embedding: bytes | None = None  # an embedding request's vector, once it came
        self._outputs: RequestStream | None = None

    @property
    def request_id(self) -> str:
        return self._request.request_id

    async def __aenter__(self) -> Generation:
        self._outputs = self._engine.add(self._request)
        if self._hooks.sent is not None:
            self._hooks.sent(self._request)
        return self

    def _started(self) -> None:
        if self._hooks.started is not None:
            self._hooks.started(self.request_id)
            self._hooks = replace(self._hooks, started=None)

    async def __aexit__(self, *exc_info: object) -> None:
        self._started()
        if self._outputs is not None:
            self._outputs.close()
            self._timer.finish(FinishReason.ABORT)  # unless it finished or failed before

    async def deltas(self) -> AsyncIterator[Delta]:
        """Text deltas; the last one carries the finish reason. Empty steps are skipped."""
        assert self._outputs is not None, "use `async with` first"
        try:
            async with contextlib.aclosing(self._deltas(self._outputs)) as deltas:
                async for delta in deltas:
                    if delta.finish_reason is not None:
                        self._timer.finish(delta.native_finish_reason or delta.finish_reason)
                    yield delta
        except (EngineUnavailableError, EngineRequestError):
            self._timer.finish(ERROR)
            raise

    async def _deltas(self, outputs: RequestStream) -> AsyncIterator[Delta]:
        async for output in outputs:
            self._started()
            self._timer.tokens(len(output.new_token_ids), output.queue_time_s)
            if self._hooks.generated is not None and output.new_token_ids:
                self._hooks.generated(len(output.new_token_ids))
            self.usage.cached_tokens = output.num_cached_tokens
            if output.embedding is not None:
                self.embedding = output.embedding
            delta = self._step_delta(output)
            if delta is not None:
                yield delta
                if delta.finish_reason is not None:
                    return

    def _step_delta(self, output: RequestOutput) -> Delta | None:
        """A step's tokens (several where drafts were accepted) as one delta, made token by
        token and cut at the first that ends the request: one event per step, as vLLM
        streams, rather than one per token (each event costs the frontend a socket send)."""
        merged: Delta | None = None
        for single in one_token_each(output):
            delta = self._delta(single)
            if delta is None:
                continue
            if merged is not None:
                delta = replace(delta, text=merged.text + delta.text,
                                logprobs=merged.logprobs + delta.logprobs)
            merged = delta
            if delta.finish_reason is not None:
                break
        return merged

    def _delta(self, output: RequestOutput) -> Delta | None:
        """One output of at most one token as text: stop strings then see every token the
        way a step-by-step engine sends them, and nothing past a stop is counted."""
        self.usage.completion_tokens += len(output.new_token_ids)
        token_ids = output.new_token_ids
        finish_reason = output.finish_reason
        if (
            finish_reason == FinishReason.STOP
            and token_ids
            and token_ids[-1] in self._stop_token_ids
        ):
            token_ids = token_ids[:-1]
        if token_ids and min(token_ids) < 0:
            raise EngineRequestError(f"the engine sent negative token ids: {token_ids}")
        text, logprobs = self._detokenize(token_ids, output.logprobs)
        if finish_reason is not None:
            text += self._detokenizer.flush()
        matched = self._stop_strings.feed(text)
        if matched.stopped:
            return Delta(matched.text, FinishReason.STOP, logprobs, matched.stop)
        if finish_reason == FinishReason.TIMEOUT:
            return Delta(matched.text + self._stop_strings.flush(), FinishReason.LENGTH,
                         logprobs, native_finish_reason=FinishReason.TIMEOUT)
        if finish_reason is not None:
            return Delta(matched.text + self._stop_strings.flush(), finish_reason, logprobs)
        if matched.text or logprobs:
            return Delta(matched.text, logprobs=logprobs)
        return None

    def _detokenize(
        self, token_ids: list[int], raw_logprobs: list[Any] | None
    ) -> tuple[str, list[TokenLogprob]]:
        if not self._wants_logprobs:
            text = self._detokenizer.push(token_ids)
            self._text_length += len(text)
            return text, []
        raw_logprobs = raw_logprobs or []
        if len(raw_logprobs) < len(token_ids):
            raise EngineRequestError(
                f"the engine sent {len(raw_logprobs)} logprobs for {len(token_ids)} tokens"
            )
        # One token at a time, so each token's text offset is known.
        pieces: list[str] = []
        logprobs: list[TokenLogprob] = []
        for token_id, raw in zip(token_ids, raw_logprobs, strict=False):
            logprobs.append(_token_logprob(token_id, raw, self._text_length))
            piece = self._detokenizer.push([token_id])
            self._text_length += len(piece)
            pieces.append(piece)
        return "".join(pieces), logprobs

    async def collect(self) -> Delta:
        """The whole text and the finish reason, for non-streaming responses."""
        parts: list[str] = []
        logprobs: list[TokenLogprob] = []
        last = Delta("")
        async for delta in self.deltas():
            parts.append(delta.text)
            logprobs.extend(delta.logprobs)
            last = delta
        return Delta("".join(parts), last.finish_reason, logprobs, last.stop_sequence,
                     last.native_finish_reason)


def one_token_each(output: RequestOutput) -> list[RequestOutput]:
    """An output of several tokens (accepted drafts) as one output per token; the finish
    reason goes with the last."""
    token_ids = output.new_token_ids
    if len(token_ids) <= 1:
        return [output]
    logprobs = output.logprobs
    return [RequestOutput(output.request_id, [token_id],
                          output.finish_reason if index == len(token_ids) - 1 else None,
                          output.num_cached_tokens,
                          None if logprobs is None else logprobs[index:index + 1])
            for index, token_id in enumerate(token_ids)]


def _token_logprob(token_id: int, raw: Any, text_offset: int) -> TokenLogprob:
    """One token's [chosen logprob, [[top id, logprob], ...]] as the engine sent it."""
    try:
        chosen, top = raw
        top_pairs = [(_token_id(top_id), _logprob(value)) for top_id, value in top]
        return TokenLogprob(token_id, _logprob(chosen), top_pairs, text_offset)
    except (TypeError, ValueError, OverflowError) as exc:
        raise EngineRequestError(f"the engine sent malformed logprobs: {exc}") from exc


def _token_id(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{value!r} is not a token id")
    return value


def _logprob(value: Any) -> float:
    logprob = float(value)
    if math.isnan(logprob):
        raise ValueError(f"{value!r} is not a log probability")
    return logprob
