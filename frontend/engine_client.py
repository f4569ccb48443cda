"""The frontend's side of the engine sockets.

One reader task owns the output socket and routes every entry of every frame to the
queue of the request it belongs to. Requests go out on the request socket; a request
that is left before the engine finished it (client gone, stop string, cancellation)
is ABORTed.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import time
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

from common import protocol
from common.curve import HANDSHAKE_FAILURES, CurveKeys
from common.protocol import (
    AbortRequests,
    AddRequest,
    FinishReason,
    KVBlocks,
    Ready,
    RequestError,
    RequestOutput,
    StepOutputs,
    StepStats,
)
from common.sockets import is_tcp, make_socket
from frontend.metrics import LoomMetrics
from frontend.request_stream import (
    EngineBusyError,
    EngineDeadError,
    QueueItem,
    RequestStream,
    ShuttingDownError,
    StreamFailure,
)

logger = logging.getLogger("loom.frontend.engine")

# After the engine's output connection drops, frames it sent just before may still be
# queued locally; they are delivered before the in-flight requests are failed.
DISCONNECT_GRACE_S = 0.2
# Last ABORTs get this long to leave on close; an engine that is not reading must not
# hold up the frontend's exit.
SHUTDOWN_LINGER_MS = 200
# A refused engine retries every 100 ms: one log line per this many seconds.
REFUSAL_LOG_INTERVAL_S = 60.0


class LinkState(enum.Enum):
    """Where the link to one engine stands; only SERVING takes requests."""

    CONNECTING = "connecting"  # a remote engine that has not sent READY yet
    SERVING = "serving"
    DISCONNECTED = "disconnected"  # a reconnect (local) or a READY (remote) revives it
    EXITED = "exited"  # a local process is gone: only a restarted one revives it


class EngineClient:
    """`rank`: the engine's data-parallel rank (its label in the metrics). `restartable`:
    launch.py restarts this engine when it dies (several engines), so a process that exited
    comes back when a new one binds the addresses; with one engine, an exit is final.

    An engine on another host (tcp addresses) connects to us instead: we bind, as the CURVE
    server of `curve`'s keys, and admit only engines whose key comes from the shared secret
    (common.curve). It counts as serving from its READY frame until it disconnects."""

    def __init__(
        self, requests_addr: str, outputs_addr: str, metrics: LoomMetrics | None = None,
        rank: int = 0, restartable: bool = False, curve: CurveKeys | None = None,
        expected: Ready | None = None,
    ) -> None:
        self.metrics = metrics if metrics is not None else LoomMetrics()
        self.rank = rank
        self.remote = is_tcp(requests_addr) or is_tcp(outputs_addr)
        self.restartable = restartable or self.remote
        self.restarts = 0  # processes that came back after this rank's engine exited
        self.ready: Ready | None = expected  # what the engine serves, once known
        # What the other engines serve (set by EnginePool): a remote engine must match it.
        self.peers_model: Callable[[], Ready | None] = lambda: None
        self._refusal_logged_at = -math.inf
        if self.remote and curve is None:
            raise ValueError(f"engine {rank} is on tcp: its link needs CURVE keys")
        self._context = zmq.asyncio.Context()
        # Sends are never awaited: an ABORT must go out from a `finally` of a cancelled
        # task or a closing generator, so the request socket is a plain socket used with
        # NOBLOCK (its high-water mark is generous) on the same libzmq context.
        self._sync_context = zmq.Context.shadow(self._context.underlying)
        self._authenticator: AsyncioAuthenticator | None = None
        self._open_sockets(requests_addr, outputs_addr, curve)
        self._queues: dict[str, asyncio.Queue[QueueItem]] = {}
        # Where a prefill leg's KV_BLOCKS go (frontend.disaggregation), by request id.
        self.kv_sinks: dict[str, Callable[[list[zmq.Frame]], None]] = {}
        self._tasks: list[asyncio.Task] = []
        self.num_bad_frames = 0
        # A remote engine serves from its READY on.
        self.link = LinkState.CONNECTING if self.remote else LinkState.SERVING
        self._shutdown_reason: str | None = None  # set by fail_all: no new requests either
        self.last_stats = StepStats()
        self.last_step = -1

    def _open_sockets(self, requests_addr: str, outputs_addr: str,
                      curve: CurveKeys | None) -> None:
        """Where one fails, what opened is closed and the context ended: an open socket
        would make the context's garbage collection wait on it for ever."""
        opened: list[zmq.Socket] = []
        try:
            secure = None
            if self.remote and curve is not None:
                # The ZAP handler runs before any socket binds: no handshake goes unchecked.
                self._authenticator = AsyncioAuthenticator(self._context)
                self._authenticator.start()
                self._authenticator.configure_curve_callback("*", EngineKeyCheck(curve,
                                                                                 self.rank))
                secure = curve.secure_server
            self._requests = make_socket(self._sync_context, zmq.PUSH, requests_addr,
                                         bind=self.remote, secure=secure)
            opened.append(self._requests)
            self._outputs = make_socket(self._context, zmq.PULL, outputs_addr,
                                        bind=self.remote, secure=secure)
            opened.append(self._outputs)
            self._monitor = self._outputs.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILURES)
        except BaseException:
            for socket in opened:
                socket.close(linger=0)
            if self._authenticator is not None:
                self._authenticator.stop()
            self._context.term()
            raise

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._read_outputs(), name="engine-outputs-reader"),
            asyncio.create_task(self._watch_connection(), name="engine-connection-watch"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        self._outputs.disable_monitor()
        self._monitor.close(linger=0)
        self._outputs.close(linger=0)
        self._requests.close(linger=SHUTDOWN_LINGER_MS)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()

    @property
    def engine_dead(self) -> bool:
        return self.link is not LinkState.SERVING

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    @property
    def num_waiting_estimate(self) -> int:
        """Requests sent to the engine and not yet running there, as of the latest stats."""
        return max(self.num_in_flight - self.last_stats.num_running, 0)

    def add(self, request: AddRequest) -> RequestStream:
        """Send a request now; its outputs arrive through the returned stream.

        Raises EngineDeadError or EngineBusyError when the request cannot be sent.
        """
        if self.engine_dead:
            raise EngineDeadError("the engine is not running")
        if self._shutdown_reason is not None:
            raise ShuttingDownError(self._shutdown_reason)
        if request.request_id in self._queues:
            raise ValueError(f"duplicate request id {request.request_id}")
        queue: asyncio.Queue[QueueItem] = asyncio.Queue()
        self._queues[request.request_id] = queue
        try:
            self._send(request)
        except BaseException:
            del self._queues[request.request_id]
            raise
        return RequestStream(request.request_id, queue, self._release)

    def abort(self, request_ids: list[str]) -> None:
        """ABORT requests; their iterators end with finish_reason "abort"."""
        for request_id in request_ids:
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(RequestOutput(request_id, [], FinishReason.ABORT))
        self._abort_nowait(request_ids)

    def _release(self, request_id: str, abort: bool) -> None:
        self._queues.pop(request_id, None)
        if abort:
            self._abort_nowait([request_id])

    def _abort_nowait(self, request_ids: list[str]) -> None:
        try:
            self._send(AbortRequests(list(request_ids)))
        except (EngineBusyError, zmq.ZMQError) as exc:
            logger.warning("could not send ABORT for %s: %s", request_ids, exc)

    def _send(self, message: protocol.Message) -> None:
        try:
            self._requests.send(protocol.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again as exc:
            raise EngineBusyError("the engine's request queue is full") from exc

    def fail_all(self, reason: str) -> None:
        """End every open request with ShuttingDownError, and refuse new ones; the engine
        gets their ABORTs."""
        self._shutdown_reason = reason
        for queue in self._queues.values():
            queue.put_nowait(StreamFailure(ShuttingDownError(reason), engine_gone=False))

    async def engine_exited_with(self, reason: str) -> None:
        """The engine process is gone (its sentinel fired): fail whatever is in flight."""
        if self.link is LinkState.EXITED:
            return
        logger.error("engine %d process exited: %s", self.rank, reason)
        self._process_gone()
        self.metrics.engine_gone(self.rank)
        await self._fail_in_flight_after_grace(reason)

    def _process_gone(self) -> None:
        if not self.remote:
            self.link = LinkState.EXITED
        elif self.link is LinkState.SERVING:  # its successor announces itself with READY
            self.link = LinkState.DISCONNECTED

    async def _read_outputs(self) -> None:
        while True:
            parts = await self._outputs.recv_multipart(copy=False)
            if len(parts) == 1:
                self.handle_frame(parts[0].bytes)
            else:
                self.handle_kv_blocks(parts)

    def handle_kv_blocks(self, parts: list[zmq.Frame]) -> None:
        """A prefill leg's KV: relayed as is to its request's decode engine, or dropped
        when the request has none any more."""
        try:
            message = protocol.decode_message(parts[0].bytes, len(parts))
        except protocol.FrameError as exc:
            self._count_bad_frame()
            logger.warning("dropped a bad KV frame from engine %d: %s", self.rank, exc)
            return
        assert isinstance(message, KVBlocks)  # the one message of two parts
        sink = self.kv_sinks.get(message.request_id)
        if sink is not None:
            sink(parts)
            self.metrics.kv_transfer_bytes.inc(len(parts[1]))

    def relay_kv(self, parts: list[zmq.Frame]) -> None:
        """Another engine's KV_BLOCKS for a request about to be added here."""
        try:
            self._requests.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # the request recomputes what did not arrive
            logger.warning("engine %d is not reading: KV blocks dropped", self.rank)

    def handle_frame(self, frame: bytes) -> None:
        """Decode one engine frame and route it; a frame that fails is counted and dropped."""
        try:
            message = protocol.decode(frame)
        except protocol.FrameError as exc:
            self._count_bad_frame()
            logger.warning("dropped a bad frame from the engine (%d bytes): %s", len(frame), exc)
            return
        try:
            self._route(message)
        except Exception:
            self._count_bad_frame()
            logger.exception("failed to route a %s frame", type(message).__name__)

    def _count_bad_frame(self) -> None:
        self.num_bad_frames += 1
        self.metrics.frontend_bad_frames.inc()

    def _route(self, message: protocol.Message) -> None:
        if isinstance(message, StepOutputs):
            self.last_step = message.step
            self.last_stats = message.stats
            self.metrics.observe_step(message.stats, self.rank)
            for output in message.outputs:
                queue = self._queues.get(output.request_id)
                if queue is not None:  # else: finished or aborted here, engine not yet told
                    queue.put_nowait(output)
        elif isinstance(message, Ready) and self.remote:
            self._remote_ready(message)
        elif isinstance(message, RequestError):
            queue = self._queues.get(message.request_id)
            if queue is not None:
                queue.put_nowait(message)
            else:
                logger.warning(
                    "engine error for unknown request %s: %s", message.request_id, message.reason
                )
        else:
            self._count_bad_frame()
            logger.warning("dropped an unexpected %s frame from the engine", type(message).__name__)

    def _remote_ready(self, ready: Ready) -> None:
        """A remote engine announced itself: it serves if it serves the same model as before,
        and as the other engines."""
        expected = self.ready or self.peers_model()
        if expected is not None and not same_model(expected, ready):
            logger.error("engine %d serves %s (blocks of %d, vocab %d), not %s: ignored",
                         self.rank, ready.model_name, ready.block_size, ready.vocab_size,
                         expected.model_name)
            return
        if self.link is not LinkState.SERVING:
            if self.link is LinkState.DISCONNECTED:  # it had joined before
                self._count_restart()
            logger.info("engine %d joined: %s", self.rank, ready.model_name)
        self.ready = ready
        self.link = LinkState.SERVING

    def _count_restart(self) -> None:
        self.restarts += 1
        self.metrics.engine_restarts.labels(str(self.rank)).inc()

    async def _watch_connection(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] & HANDSHAKE_FAILURES:
                now = time.monotonic()
                if now - self._refusal_logged_at > REFUSAL_LOG_INTERVAL_S:  # it retries
                    self._refusal_logged_at = now
                    logger.error("refused an engine connection on %s: it failed the CURVE "
                                 "handshake (not the shared secret's key)",
                                 event["endpoint"].decode(errors="replace"))
                continue
            if self.remote:
                if (event["event"] == zmq.EVENT_DISCONNECTED
                        and self.link is LinkState.SERVING):
                    await self._lose_connection(f"the connection to engine {self.rank} was lost")
                continue
            if event["event"] == zmq.EVENT_CONNECTED:
                self._local_connected()
            elif (event["event"] == zmq.EVENT_DISCONNECTED
                  and self.link is not LinkState.EXITED):
                await self._lose_connection("the connection to the engine was lost")

    def _local_connected(self) -> None:
        if self.link is LinkState.EXITED and self.restartable:
            logger.info("engine %d is back (restarted)", self.rank)
            self._count_restart()
            self.link = LinkState.SERVING
        elif self.link is LinkState.DISCONNECTED:
            logger.info("engine %d reconnected", self.rank)
            self.link = LinkState.SERVING

    async def _lose_connection(self, reason: str) -> None:
        logger.error("lost the connection to engine %d", self.rank)
        self.link = LinkState.DISCONNECTED
        self.metrics.engine_gone(self.rank)
        await self._fail_in_flight_after_grace(reason)

    async def _fail_in_flight_after_grace(self, reason: str) -> None:
        # The reader drains what is queued within the grace. Peeking at the socket's EVENTS
        # from here instead would steal the reader's wake-up and stall both (pyzmq #2173).
        await asyncio.sleep(DISCONNECT_GRACE_S)
        if not self.engine_dead:
            return
        failure = StreamFailure(EngineDeadError(f"The engine stopped: {reason}."), engine_gone=True)
        for queue in self._queues.values():
            queue.put_nowait(failure)


def same_model(first: Ready, second: Ready) -> bool:
    return (first.model_name, first.block_size, first.vocab_size, first.max_model_len) == (
        second.model_name, second.block_size, second.vocab_size, second.max_model_len)


class EngineKeyCheck:
    """ZAP: a remote engine is admitted only with the client key of the shared secret."""

    def __init__(self, curve: CurveKeys, rank: int) -> None:
        self.allowed = curve.client_public
        self.rank = rank

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.allowed:
            return True
        logger.error("refused an engine for rank %d: its key is not the shared secret's",
                     self.rank)
        return False
