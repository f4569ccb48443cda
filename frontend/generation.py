"""One request's run: engine outputs → detokenized text deltas, stop strings applied.

Leaving the `async with` before the engine finished the request (stop string, client
gone, error) ABORTs it in the engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from common.protocol import AddRequest, FinishReason
from frontend.detokenizer import IncrementalDetokenizer
from frontend.engine_client import EngineClient, RequestStream
from frontend.stop_strings import StopStringMatcher


@dataclass(slots=True)
class Delta:
    text: str
    finish_reason: str | None = None


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


class Generation:
    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Any,
        request: AddRequest,
        stop: list[str],
        eos_token_ids: list[int],
    ) -> None:
        self._engine = engine
        self._request = request
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stop_strings = StopStringMatcher(stop)
        sampling = request.sampling
        # A finishing stop token counts as generated but is not part of the text.
        self._stop_token_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            self._stop_token_ids.update(eos_token_ids)
        self.usage = Usage(prompt_tokens=len(request.prompt_token_ids))
        self._outputs: RequestStream | None = None

    @property
    def request_id(self) -> str:
        return self._request.request_id

    async def __aenter__(self) -> Generation:
        self._outputs = self._engine.add(self._request)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._outputs is not None:
            self._outputs.close()

    async def deltas(self) -> AsyncIterator[Delta]:
        """Text deltas; the last one carries the finish reason. Empty steps are skipped."""
        assert self._outputs is not None, "use `async with` first"
        async for output in self._outputs:
            self.usage.completion_tokens += len(output.new_token_ids)
            self.usage.cached_tokens = output.num_cached_tokens
            token_ids = output.new_token_ids
            finish_reason = output.finish_reason
            if (
                finish_reason == FinishReason.STOP
                and token_ids
                and token_ids[-1] in self._stop_token_ids
            ):
                token_ids = token_ids[:-1]
            text = self._detokenizer.push(token_ids)
            if finish_reason is not None:
                text += self._detokenizer.flush()
            matched = self._stop_strings.feed(text)
            if matched.stopped:
                yield Delta(matched.text, FinishReason.STOP)
                return
            if finish_reason is not None:
                yield Delta(matched.text + self._stop_strings.flush(), finish_reason)
                return
            if matched.text:
                yield Delta(matched.text)

    async def collect(self) -> Delta:
        """The whole text and the finish reason, for non-streaming responses."""
        parts: list[str] = []
        finish_reason = None
        async for delta in self.deltas():
            parts.append(delta.text)
            finish_reason = delta.finish_reason
        return Delta("".join(parts), finish_reason)
