"""Stored Responses (`store: true`, the default): kept in memory for GET, DELETE and
`previous_response_id`, the least recently used evicted beyond MAX_STORED_RESPONSES."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from frontend.errors import APIError

MAX_STORED_RESPONSES = 1024


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages, input and output (no instructions)


def not_found(response_id: str) -> APIError:
    return APIError(f"Response with id '{response_id}' not found.", status=404)


@dataclass(slots=True)
class ResponseStore:
    capacity: int = MAX_STORED_RESPONSES
    _stored: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._stored)

    def put(self, stored: StoredResponse) -> None:
        self._stored[stored.response["id"]] = stored
        self._stored.move_to_end(stored.response["id"])
        while len(self._stored) > self.capacity:
            self._stored.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        stored = self._stored.get(response_id)
        if stored is None:
            raise not_found(response_id)
        self._stored.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        if self._stored.pop(response_id, None) is None:
            raise not_found(response_id)
