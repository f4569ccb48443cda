"""A generation streamed as named server-sent events (Anthropic's Messages, OpenAI's
Responses): the reply object turns the run's opening, each text delta and its finish into
events; an engine failure mid-stream becomes the API's error event."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web

from frontend.errors import APIError, internal_error
from frontend.generation import Delta, Generation, Usage
from frontend.openai_api import engine_failure, log_finished
from frontend.request_stream import EngineRequestError, EngineUnavailableError
from frontend.sse import EventStream

logger = logging.getLogger("loom.frontend.events")
Event = tuple[str, dict[str, Any]]


class EventReply(Protocol):
    def start_events(self, usage: Usage) -> list[Event]: ...

    def delta_events(self, delta: Delta) -> list[Event]: ...

    def finish_events(self, last: Delta, usage: Usage) -> list[Event]: ...


async def stream_reply(request: web.Request, generation: Generation, reply: EventReply,
                       error_event: Callable[[APIError], Event]) -> web.StreamResponse:
    events = EventStream(request)
    await events.open()
    last = Delta("")
    try:
        try:
            for name, payload in reply.start_events(generation.usage):
                await events.send_named(name, payload)
            async with contextlib.aclosing(generation.deltas()) as deltas:
                async for delta in deltas:
                    for name, payload in reply.delta_events(delta):
                        await events.send_named(name, payload)
                    last = delta
            for name, payload in reply.finish_events(last, generation.usage):
                await events.send_named(name, payload)
        except (EngineUnavailableError, EngineRequestError) as exc:
            logger.warning("%s failed mid-stream: %s", generation.request_id, exc)
            await events.send_named(*error_event(engine_failure(exc)))
        except Exception:  # the stream is open: no status to send, an error event instead
            logger.exception("%s: unhandled error mid-stream", generation.request_id)
            await events.send_named(*error_event(internal_error("Internal server error.")))
        await events.close()
    except ConnectionResetError:
        logger.info("%s: client disconnected", generation.request_id)
        return events.response
    log_finished(generation, last.finish_reason)
    return events.response
