"""The Responses store: bounded, least recently used out first, unknown ids a 404."""

from __future__ import annotations

import pytest

from frontend.errors import APIError
from frontend.response_store import ResponseStore, StoredResponse


def stored(response_id: str) -> StoredResponse:
    return StoredResponse({"id": response_id, "object": "response"},
                          [{"role": "user", "content": response_id}])


def test_the_least_recently_used_response_goes_first() -> None:
    store = ResponseStore(capacity=2)
    store.put(stored("a"))
    store.put(stored("b"))
    assert store.get("a").conversation[0]["content"] == "a"  # a is now the most recent
    store.put(stored("c"))
    assert len(store) == 2
    with pytest.raises(APIError) as caught:
        store.get("b")
    assert caught.value.status == 404 and "'b'" in caught.value.message
    assert store.get("c").response["id"] == "c"


def test_a_deleted_response_is_gone_and_deleting_it_again_is_a_404() -> None:
    store = ResponseStore()
    store.put(stored("a"))
    store.delete("a")
    for call in (store.get, store.delete):
        with pytest.raises(APIError) as caught:
            call("a")
        assert caught.value.status == 404
