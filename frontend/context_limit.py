"""How many tokens a request may use: the model's context, and what the KV cache can hold."""

from __future__ import annotations

from dataclasses import dataclass

from common.protocol import Ready
from frontend.errors import APIError


@dataclass(frozen=True, slots=True)
class ContextLimit:
    max_model_len: int
    kv_cache_tokens: int  # a request larger than the whole cache can never run

    @classmethod
    def of(cls, info: Ready) -> ContextLimit:
        return cls(info.max_model_len, info.num_kv_blocks * info.block_size)

    @property
    def tokens(self) -> int:
        return min(self.max_model_len, self.kv_cache_tokens)

    def max_tokens_for(self, prompt_tokens: int, requested: int | None, prompt_param: str) -> int:
        """max_tokens to send: as requested, or whatever the context leaves (as vLLM does)."""
        room = self.tokens - prompt_tokens
        if requested is None and room < 1:
            raise APIError(
                f"{self._limit_phrase()}. However, the prompt has {prompt_tokens} tokens, "
                "which leaves no room for a completion. Please shorten the prompt.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if requested is not None and requested > room:
            raise APIError(
                f"{self._limit_phrase()}. However, you requested {prompt_tokens + requested} "
                f"tokens ({prompt_tokens} in the prompt, {requested} in max_tokens). "
                "Please reduce the length of the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested if requested is not None else room

    def _limit_phrase(self) -> str:
        if self.max_model_len <= self.kv_cache_tokens:
            return f"This model's maximum context length is {self.max_model_len} tokens"
        return (
            f"The engine's KV cache holds at most {self.kv_cache_tokens} tokens per request "
            f"(the model's context length is {self.max_model_len})"
        )
