"""A stream's first event carries its first token, through launch.py over real HTTP.

The engine is held with SIGSTOP while a streaming request waits for its first token: no
event may reach the client in that time (a chat role chunk sent at acceptance would make
clients that time the first chunk, such as `vllm bench serve`, report a TTFT the server
does not have). After SIGCONT each choice's first event holds its first token, the chat
role with it. A request whose engine dies before its first token still gets an error event.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from tests.launched_server import LaunchedServer
from tests.tiny_server import TINY_MODEL_NAME, shared_tiny_model, tiny_server

pytestmark = pytest.mark.e2e

HOLD_S = 1.0  # the engine is stopped this long; an early event would arrive in milliseconds
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass
class Events:
    """A stream's `data:` payloads, each with its monotonic arrival time."""

    payloads: list[tuple[float, Any]] = field(default_factory=list)
    first: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [payload for _, payload in self.payloads if payload != "[DONE]"]


async def read_stream(http: aiohttp.ClientSession, url: str, body: dict, events: Events) -> None:
    async with http.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.strip()
            if line.startswith(b"data: "):
                data = line[len(b"data: "):]
                payload = "[DONE]" if data == b"[DONE]" else json.loads(data)
                events.payloads.append((time.monotonic(), payload))
                events.first.set()


def body(path: str, n: int, echo: bool = False) -> dict[str, Any]:
    common = {"model": TINY_MODEL_NAME, "max_tokens": 4, "n": n, "stream": True,
              "ignore_eos": True}
    if path == CHAT:
        return common | {"messages": [{"role": "user", "content": "Hello there"}]}
    return common | {"prompt": "Hello there", "echo": echo}


def first_chunk_per_choice(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    firsts: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            firsts.setdefault(choice["index"], choice)
    return firsts


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    launched = tiny_server(shared_tiny_model(tmp_path_factory), "--num-kv-blocks", "512")
    launched.start(tmp_path_factory.mktemp("logs"))
    yield launched
    assert launched.stop() == 0, launched.log


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize(("path", "echo"), [(CHAT, False), (COMPLETIONS, False),
                                            (COMPLETIONS, True)])
async def test_no_event_before_the_first_token(server: LaunchedServer, path: str, echo: bool,
                                               n: int) -> None:
    engine = server.child("engine")
    events = Events()
    async with aiohttp.ClientSession() as http:
        os.kill(engine, signal.SIGSTOP)
        try:
            reading = asyncio.create_task(
                read_stream(http, server.base_url + path, body(path, n, echo), events))
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(asyncio.shield(events.first.wait()), HOLD_S)
            resumed_at = time.monotonic()
        finally:
            os.kill(engine, signal.SIGCONT)
        await asyncio.wait_for(reading, 60)
    assert events.payloads[0][0] > resumed_at
    firsts = first_chunk_per_choice(events.chunks)
    assert sorted(firsts) == list(range(n))
    for choice in firsts.values():
        if path == CHAT:
            assert choice["delta"]["role"] == "assistant"
            assert choice["delta"]["content"], "the role arrives with the first token"
        elif echo:
            assert choice["text"].startswith("Hello there") and choice["text"] != "Hello there"
        else:
            assert choice["text"], "the first event holds the first token"
    assert events.payloads[-1][1] == "[DONE]"


async def test_engine_dying_before_the_first_token_sends_an_error_event(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    server = tiny_server(shared_tiny_model(tmp_path_factory), "--num-kv-blocks", "512")
    server.start(tmp_path_factory.mktemp("logs"))
    try:
        engine = server.child("engine")
        events = Events()
        async with aiohttp.ClientSession() as http:
            os.kill(engine, signal.SIGSTOP)
            reading = asyncio.create_task(
                read_stream(http, server.base_url + CHAT, body(CHAT, 1), events))
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(asyncio.shield(events.first.wait()), HOLD_S)
            os.kill(engine, signal.SIGKILL)
            await asyncio.wait_for(reading, 30)
        (error_event,) = events.chunks
        assert "engine" in error_event["error"]["message"].lower()
        assert events.payloads[-1][1] == "[DONE]"
    finally:
        server.stop()
