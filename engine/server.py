"""The engine process's loop: block on input when idle, drain without blocking when busy, step."""

from __future__ import annotations

import logging
import os

import zmq
from zmq.utils.monitor import parse_monitor_message

from common.curve import HANDSHAKE_FAILURES, CurveKeys
from common.protocol import (
    AbortRequests,
    AddRequest,
    FrameError,
    KVBlocks,
    Message,
    RequestError,
    Shutdown,
    decode_message,
    encode,
    refused_add_id,
)
from common.sockets import is_tcp, make_socket
from engine.core import EngineCore
from engine.give_way import ArrivalWatch
from engine.scheduler import RequestRefused
from engine.stats_log import StatsLogger

logger = logging.getLogger("loom.engine")

IDLE_POLL_MS = 1000
GRAMMAR_POLL_MS = 2  # idle, but a constrained request waits for its grammar build


class EngineServer:
    """Binds its sockets for a frontend on this host (ipc). An engine on another host
    (tcp, `launch.py --headless`) connects to the frontend instead, as a CURVE client of
    `curve`'s keys, and sends its READY each time the link comes up."""

    def __init__(self, core: EngineCore, requests_addr: str, outputs_addr: str,
                 curve: CurveKeys | None = None) -> None:
        self.core = core
        remote = is_tcp(requests_addr) or is_tcp(outputs_addr)
        if remote and curve is None:
            raise ValueError("an engine on tcp needs CURVE keys (common.curve)")
        secure = curve.secure_client if remote and curve is not None else None
        self.context = zmq.Context()
        try:
            self.requests = make_socket(self.context, zmq.PULL, requests_addr,
                                        bind=not remote, secure=secure)
            self.outputs = make_socket(self.context, zmq.PUSH, outputs_addr, bind=not remote,
                                       secure=secure)
            self.link_events = self.outputs.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILURES) if remote else None
        except BaseException:
            # An open socket would make the context's garbage collection wait on it forever.
            self.context.destroy(linger=0)
            raise
        self.refusals = 0  # failed handshakes with the frontend (logged on the first)
        self.stats_logger = StatsLogger()
        self.num_bad_frames = 0
        self.parent_pid = os.getppid()
        self.running = True
        self._wake_read, self._wake_write = os.pipe()  # `stop` ends an idle poll at once
        self.poller = zmq.Poller()
        self.poller.register(self.requests, zmq.POLLIN)
        self.poller.register(self._wake_read, zmq.POLLIN)
        self.arrivals = ArrivalWatch(self.requests, lambda: core.scheduler)  # read mid-step

    def stop(self) -> None:
        """Ends the loop after its step or poll; safe from a signal handler, also once the
        server is closed (a second SIGTERM while the engine shuts down)."""
        self.running = False
        if self._wake_write >= 0:
            os.write(self._wake_write, b"\0")

    def _requests_arrived(self, timeout_ms: int) -> bool:
        return self.requests in dict(self.poller.poll(timeout_ms))

    def serve_forever(self) -> None:
        try:
            was_busy = False
            while self.running:
                if not self.core.has_work:
                    if was_busy:
                        self._report_idle()
                    was_busy = False
                    waiting = self.core.num_awaiting_grammar
                    if not self.arrivals.held and not self._requests_arrived(
                            GRAMMAR_POLL_MS if waiting else IDLE_POLL_MS):
                        self._stop_if_orphaned()
                        self._announce_on_new_links()
                        self._admit_constrained()
                        continue
                self._announce_on_new_links()
                self._drain_requests()
                self._admit_constrained()
                self._expire_deadlines()
                if self.running and self.core.has_work:
                    was_busy = True
                    step_outputs = self.core.step(self.arrivals)
                    if step_outputs is None:  # it gave way to a request that just arrived
                        continue
                    step_outputs.stats.bad_frames_total = self.num_bad_frames
                    for header, payload in self.core.kv_transfer.collect():  # before its token
                        self.outputs.send_multipart([encode(header), payload], copy=False)
                    self.outputs.send(encode(step_outputs), copy=False)
                    self.stats_logger.observe(step_outputs.stats)
        finally:
            self.close()

    def _admit_constrained(self) -> None:
        if self.core.num_awaiting_grammar:
            for error in self.core.admit_constrained():
                self.outputs.send(encode(error))

    def _expire_deadlines(self) -> None:
        errors, finished = self.core.expire_deadlines()
        for error in errors:
            self.outputs.send(encode(error))
        if finished is not None:
            finished.stats.bad_frames_total = self.num_bad_frames
            self.outputs.send(encode(finished))

    def _report_idle(self) -> None:
        """Going idle: check that no KV block leaked, and tell the frontend we are at rest."""
        self.core.check_integrity()
        idle = self.core.idle_outputs()
        idle.stats.bad_frames_total = self.num_bad_frames
        idle.stats.at_rest = True
        self.outputs.send(encode(idle))

    def _announce_on_new_links(self) -> None:
        """On a link to a frontend on another host: READY whenever the link (re)connects."""
        if self.link_events is None:
            return
        while self.link_events.poll(0):
            event = parse_monitor_message(self.link_events.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                logger.info("connected to the frontend at %s", event["endpoint"].decode())
                self.refusals = 0
                self.outputs.send(encode(self.core.ready_message))
            else:
                self.refusals += 1
                if self.refusals == 1:  # it retries every 100 ms: once is enough
                    logger.error("the frontend at %s refused this engine: the link failed "
                                 "its CURVE handshake (a different shared secret?)",
                                 event["endpoint"].decode())

    def _stop_if_orphaned(self) -> None:
        self.core.check_ranks()  # a dead tensor-parallel rank ends this engine too
        if os.getppid() != self.parent_pid:
            logger.error("parent process %d is gone: stopping", self.parent_pid)
            self.running = False

    def _drain_requests(self) -> None:
        for parts in self.arrivals.take():  # read during the last step, in order
            self._receive(parts)
        while self.running:
            try:
                parts = self.requests.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._receive(parts)

    def _receive(self, parts: list[zmq.Frame]) -> None:
        frame = parts[0].bytes
        try:
            message = decode_message(frame, len(parts))
        except FrameError as exc:
            self.num_bad_frames += 1
            logger.warning("dropped a bad frame (%d so far): %s", self.num_bad_frames, exc)
            request_id = refused_add_id(frame)
            if request_id is not None:  # its sender waits: tell it
                self.outputs.send(encode(RequestError(
                    request_id, f"the engine could not read the request: {exc}")))
            return
        if isinstance(message, KVBlocks):
            self.core.kv_transfer.receive(message, parts[1].buffer)
        else:
            self._handle(message)

    def _handle(self, message: Message) -> None:
        if isinstance(message, AddRequest):
            try:
                self.core.add_request(message)
            except RequestRefused as exc:
                logger.info("refused %s: %s", message.request_id, exc)
                self.outputs.send(encode(RequestError(message.request_id, str(exc))))
        elif isinstance(message, AbortRequests):
            self.core.abort_requests(message.request_ids)
        elif isinstance(message, Shutdown):
            logger.info("shutdown requested")
            self.running = False
        else:
            self.num_bad_frames += 1
            logger.warning("dropped a %s frame: not a frontend message", type(message).__name__)

    def close(self) -> None:
        if self.link_events is not None:
            self.outputs.disable_monitor()
            self.link_events.close(linger=0)
        self.requests.close(linger=0)
        self.outputs.close()
        self.context.term()
        # Forgotten before closed: `stop` from a signal handler must never write to a number
        # the process has since given to another file.
        wake_read, wake_write = self._wake_read, self._wake_write
        self._wake_read = self._wake_write = -1
        os.close(wake_read)
        os.close(wake_write)
