"""One request's stream of engine outputs (`RequestStream`), the errors it ends with, and the
items the engine client routes into its queue (frontend.engine_client)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from common.protocol import RequestError, RequestOutput


class EngineUnavailableError(RuntimeError):
    """The request cannot be served: no engine, or the server is going away."""


class EngineDeadError(EngineUnavailableError):
    """The engine went away while requests were in flight, or before they were sent."""


class ShuttingDownError(EngineUnavailableError):
    """The server stopped waiting for the request while shutting down."""


class EngineBusyError(RuntimeError):
    """The request socket's queue is full: the engine is not reading."""


class EngineRequestError(RuntimeError):
    """The engine rejected or failed one request."""


class DeadlineExceededError(EngineRequestError):
    """The request's deadline passed while it waited in the engine's queue: never started."""


@dataclass(frozen=True, slots=True)
class StreamFailure:
    """Queue item: the request ends with an error without the engine finishing it."""

    error: EngineUnavailableError
    engine_gone: bool  # False: the engine still runs the request and must be told to ABORT


QueueItem = RequestOutput | RequestError | StreamFailure


class RequestStream:
    """One request's outputs, as an async iterator that ends after the finishing output.

    Outputs that queued up while the consumer was busy are merged into one. Closing the
    stream (or leaving its `async with`) before the engine finished the request ABORTs it.
    """

    def __init__(self, request_id: str, queue: asyncio.Queue[QueueItem],
                 release: Callable[[str, bool], None]) -> None:
        self.request_id = request_id
        self._release = release  # (request id, abort): the client forgets the request
        self._queue = queue
        self._stash: deque[QueueItem] = deque()  # an item that ended a merge, handled next
        self.finished = False
        self._failed = False  # a failure ends the iteration even where finished is False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    @property
    def num_pending(self) -> int:
        """Items routed to this stream and not read yet."""
        return self._queue.qsize() + len(self._stash)

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._failed:
            raise StopAsyncIteration
        item = self._stash.popleft() if self._stash else await self._queue.get()
        if isinstance(item, StreamFailure):
            self.finished = item.engine_gone
            self._failed = True
            raise item.error
        if isinstance(item, RequestError):
            self.finished = True
            if item.code == RequestError.DEADLINE_EXCEEDED:
                raise DeadlineExceededError(item.reason)
            raise EngineRequestError(item.reason)
        assert isinstance(item, RequestOutput)
        output = item
        while output.finish_reason is None and not self._queue.empty():
            queued = self._queue.get_nowait()
            if not isinstance(queued, RequestOutput):
                self._stash.append(queued)
                break
            output = _merge(output, queued)
        self.finished = output.finish_reason is not None
        return output

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._release(self.request_id, not self.finished)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


def _merge(first: RequestOutput, second: RequestOutput) -> RequestOutput:
    logprobs = None
    if first.logprobs is not None or second.logprobs is not None:
        # An output without tokens (an ABORT marker) carries no logprobs either.
        logprobs = (first.logprobs or []) + (second.logprobs or [])
    return RequestOutput(
        first.request_id,
        first.new_token_ids + second.new_token_ids,
        second.finish_reason,
        max(first.num_cached_tokens, second.num_cached_tokens),
        logprobs,
        first.queue_time_s if first.queue_time_s is not None else second.queue_time_s,
    )
