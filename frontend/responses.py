"""OpenAI response bodies and stream chunks for the completions and chat endpoints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from frontend.generation import Delta, Usage


@dataclass(slots=True)
class CompletionFormat:
    request_id: str
    model: str
    created: int
    include_usage: bool = False  # streams only: a `usage` key in every chunk, a last one set

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def delta_chunk(self, delta: Delta) -> dict[str, Any]:
        return self._chunk([_text_choice(delta)])

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._chunk([]) | {"usage": usage.to_dict()}

    def body(self, result: Delta, usage: Usage) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [_text_choice(result)],
            "usage": usage.to_dict(),
        }


@dataclass(slots=True)
class ChatFormat:
    request_id: str
    model: str
    created: int
    include_usage: bool = False

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def opening_chunks(self) -> list[dict[str, Any]]:
        return [self._chunk([_chat_delta_choice({"role": "assistant", "content": ""}, None)])]

    def delta_chunk(self, delta: Delta) -> dict[str, Any]:
        content = {"content": delta.text} if delta.text else {}
        return self._chunk([_chat_delta_choice(content, delta.finish_reason)])

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._chunk([]) | {"usage": usage.to_dict()}

    def body(self, result: Delta, usage: Usage) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": result.text},
                    "logprobs": None,
                    "finish_reason": result.finish_reason,
                }
            ],
            "usage": usage.to_dict(),
        }


def _text_choice(delta: Delta) -> dict[str, Any]:
    return {"index": 0, "text": delta.text, "logprobs": None, "finish_reason": delta.finish_reason}


def _chat_delta_choice(content: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish_reason}
