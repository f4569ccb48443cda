"""A step that gives way: while tenants contend, a request of a tenant under its share that
arrives during a step stops that step before its next attention layer (or between two kernels
of a taped one), so it starts at once in a step of its own (engine.fair_share) instead of
waiting for the step under way to end.

A step that stops runs again later, as scheduled: until `update`, it changed nothing but the
K/V of its rows' tokens, in slots no attention reads before the step that computes them (and
writes them again). So a step gives way only where that holds and nobody loses by it: on one
rank, nobody preempted in it, no drafts (the speculator counts them), no pooled rows, and no
prompt chunk of a tenant within its share (a request that started first is not stopped by the
next one). The server reads the frames that arrive mid-step to tell whether one is such a
request, and keeps them for after the step.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

from common.protocol import AddRequest, FrameError, decode_message
from engine.fair_share import SeatShares
from engine.scheduler import Scheduler, SchedulerOutput


def may_give_way(scheduled: SchedulerOutput, scheduler: Scheduler) -> bool:
    """Whether the scheduled step can stop midway and run again later."""
    fair_share = scheduler.fair_share
    if len(fair_share.accounts) < 2 or scheduled.trace.preempted:
        return False
    seat_shares = None
    for chunk in scheduled.chunks:
        if chunk.draft_token_ids or chunk.request.sampling.pooling:
            return False
        if not chunk.is_decode:
            seat_shares = seat_shares or SeatShares.of(fair_share, scheduler.running,
                                                       scheduler.config.max_num_seqs)
            if seat_shares.excess(chunk.request.tenant) <= 0:
                return False
    return True


class ArrivalWatch:
    """Mid-step reads of the engine's request socket: the frames it took are kept for the
    server's next drain; `__call__` says whether one of them starts in a step of its own."""

    def __init__(self, socket: zmq.Socket, scheduler: Callable[[], Scheduler]) -> None:
        self.socket = socket
        self.scheduler = scheduler  # the engine's, looked up when a frame arrives
        self.held: list[list[zmq.Frame]] = []

    def __call__(self) -> bool:
        urgent = False
        while self.socket.poll(0, zmq.POLLIN):
            parts = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            self.held.append(parts)
            urgent = urgent or self._is_urgent(parts)
        return urgent

    def take(self) -> list[list[zmq.Frame]]:
        held, self.held = self.held, []
        return held

    def _is_urgent(self, parts: list[zmq.Frame]) -> bool:
        try:
            message = decode_message(parts[0].bytes, len(parts))
        except FrameError:
            return False  # the drain reports it
        if not isinstance(message, AddRequest) or message.sampling.grammars:
            return False  # a constrained request waits for its grammar first
        scheduler = self.scheduler()
        return scheduler.fair_share.starts_first(message.tenant, message.tenant_weight,
                                                 scheduler.running, scheduler.config.max_num_seqs)
