"""The Messages and Responses streams over HTTP in front of the scripted fake engine: named
events in order, and a fault after the stream opened ends it with the API's error event
(never a broken body), after which the server serves the next request."""

from __future__ import annotations

import json
from typing import Any

import pytest

from frontend.anthropic_reply import MessageReply
from frontend.responses_output import ResponseReply
from tests.fake_engine import MODEL_NAME, FrontendHarness

REPLY = "Hello world! The capital of France is Paris."
MESSAGE = {"model": MODEL_NAME, "max_tokens": 50, "stream": True,
           "messages": [{"role": "user", "content": "Hi"}]}
RESPONSE = {"model": MODEL_NAME, "input": "Hi", "stream": True}


def named_events(raw: str) -> list[tuple[str, dict[str, Any]]]:
    """`event:` then `data:` per event, and nothing else (no [DONE] in these APIs)."""
    events = []
    for block in raw.split("\n\n")[:-1]:
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: "), block
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == kind[len("event: "):]
        events.append((payload["type"], payload))
    return events


async def stream(harness: FrontendHarness, path: str, body: dict[str, Any]):
    response = await harness.client.post(path, json=body)
    assert response.status == 200
    return named_events(await response.text())


async def test_a_message_streams_anthropics_events(harness: FrontendHarness) -> None:
    harness.reply_with(REPLY)
    events = await stream(harness, "/v1/messages", MESSAGE)
    kinds = [kind for kind, _ in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(p["delta"]["text"] for k, p in events if k == "content_block_delta")
    assert text == REPLY and events[-2][1]["delta"]["stop_reason"] == "end_turn"


async def test_a_response_streams_numbered_semantic_events(harness: FrontendHarness) -> None:
    harness.reply_with(REPLY)
    events = await stream(harness, "/v1/responses", RESPONSE)
    assert [p["sequence_number"] for _, p in events] == list(range(len(events)))
    text = "".join(p["delta"] for k, p in events if k == "response.output_text.delta")
    assert text == REPLY and events[-1][0] == "response.completed"
    assert events[-1][1]["response"]["output"][0]["content"][0]["text"] == REPLY


@pytest.mark.parametrize(("path", "body", "reply_class", "error"), [
    ("/v1/messages", MESSAGE, MessageReply, {"type": "error", "error": {
        "type": "api_error", "message": "Internal server error."}}),
    ("/v1/responses", RESPONSE, ResponseReply, {"type": "error", "code": "internal_error",
                                                "message": "Internal server error.",
                                                "param": None}),
], ids=["messages", "responses"])
async def test_a_fault_mid_stream_ends_it_with_the_apis_error_event(
        harness: FrontendHarness, monkeypatch: pytest.MonkeyPatch, path: str,
        body: dict[str, Any], reply_class: type, error: dict[str, Any]) -> None:
    harness.reply_with(REPLY)

    def broken(self, delta):
        raise RuntimeError("a bug in the reply's shaping")

    monkeypatch.setattr(reply_class, "delta_events", broken)
    events = await stream(harness, path, body)
    assert events[-1] == ("error", error)
    monkeypatch.undo()
    assert (await stream(harness, path, body))[-1][0] in ("message_stop", "response.completed")
