"""Iteration-level scheduler: every step re-decides which requests run and how many tokens each.

Running requests go first (a decode costs one token, an unfinished prefill gets its next
chunk), then waiting ones while token budget, seats and free blocks allow: the first, in FCFS
(or priority) order, of the tenant furthest below its fair share (engine.fair_share; without
tenants there is one, and the order is plain FCFS). When a running request needs a block and
none is free, the most recently admitted running request of the tenant furthest over its
share is preempted: its blocks are freed and it recomputes later. While tenants contend,
steps stay short for those under their share (engine.fair_share). A request whose deadline
passed is dropped from the queue, or stopped with what it generated (`expire`).
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from common.config import EngineConfig
from common.protocol import FinishReason
from engine.block_manager import BlockManager, CachedPrefix
from engine.fair_share import FairShare
from engine.request import Request, RequestStatus


class RequestRefused(ValueError):
    """A request that can never be served under this configuration."""


class WaitReason:
    NO_SEAT = "no_seat"
    NO_BUDGET = "no_budget"
    NO_BLOCKS = "no_blocks"
    BATCH_CLOSED = "batch_closed"  # static batching: the current batch has not finished
    PREEMPTION = "preemption"  # a request was preempted this step: admit nobody
    PREFIX_PENDING = "prefix_pending"  # a running request is computing this prompt's prefix
    FAIR_STEP = "fair_step"  # tenants contend: a short step for those under their share


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    num_tokens: int  # the drafts included
    draft_token_ids: list[int] = field(default_factory=list)  # verified after its last token

    @property
    def is_decode(self) -> bool:
        return self.request.num_output_tokens > 0 and self.request.num_uncomputed_tokens == 1

    @property
    def num_known_tokens(self) -> int:
        """The chunk's tokens of the request's own (not drafts)."""
        return self.num_tokens - len(self.draft_token_ids)

    @property
    def completes_sequence(self) -> bool:
        """After this chunk every token has K/V, so the step samples the next token."""
        return self.request.num_computed_tokens + self.num_known_tokens == self.request.num_tokens


@dataclass(slots=True)
class StepTrace:
    step: int
    scheduled: dict[str, int] = field(default_factory=dict)  # request id -> tokens this step
    waited: dict[str, str] = field(default_factory=dict)  # request id -> WaitReason
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    trace: StepTrace

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 eos_token_ids: Iterable[int]) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Request] = []  # sorted by _queue_key
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.requests: dict[str, Request] = {}
        self.step_count = 0
        self.num_preemptions = 0
        self.fair_share = FairShare()
        self._arrivals = itertools.count()

    # --- queue state ---------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def live_requests(self) -> list[Request]:
        return self.running + self.waiting

    def _queue_key(self, request: Request) -> tuple[int, int]:
        priority = request.priority if self.config.scheduling_policy == "priority" else 0
        return (priority, request.arrival_order)

    def _enqueue(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=self._queue_key)

    # --- admission and abort -------------------------------------------------------------
    def check_admissible(self, request: Request) -> None:
        total = request.max_total_tokens
        if total > self.max_model_len:
            raise RequestRefused(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.sampling.max_tokens}) = {total} exceeds the maximum model length "
                f"of {self.max_model_len} tokens")
        needed = self.block_manager.max_blocks_needed(total, self.config.max_num_batched_tokens)
        if needed > self.block_manager.num_blocks:
            raise RequestRefused(
                f"request needs {needed} KV blocks ({total} tokens) but the whole cache holds "
                f"{self.block_manager.num_blocks}")
        if (not self.config.enable_chunked_prefill
                and request.num_prompt_tokens > self.config.max_num_batched_tokens):
            raise RequestRefused(
                f"prompt of {request.num_prompt_tokens} tokens exceeds max_num_batched_tokens "
                f"({self.config.max_num_batched_tokens}) and chunked prefill is off")

    def add(self, request: Request) -> None:
        self.check_new(request)
        request.arrival_order = next(self._arrivals)
        self.requests[request.request_id] = request
        self.fair_share.arrived(request)
        self._enqueue(request)

    def check_new(self, request: Request) -> None:
        """Raises RequestRefused when `request` can never be served here."""
        if request.request_id in self.requests:
            raise RequestRefused(f"request id {request.request_id!r} is already in use")
        if not request.prompt_token_ids:
            raise RequestRefused("the prompt is empty")
        self.check_admissible(request)

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self._finish(request, FinishReason.ABORT)
            aborted.append(request)
        return aborted

    def _finish(self, request: Request, reason: str) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
            self.fair_share.left_queue(request)
        self.block_manager.free(request)
        request.finish(reason)
        del self.requests[request.request_id]

    def expire(self, now: float) -> tuple[list[Request], list[Request]]:
        """Finishes every request whose deadline is past `now` (time.monotonic()), with
        reason TIMEOUT. Returns those that never started (waiting, nothing generated: the
        client gets an error) and those cut short (their output so far stands)."""
        never_started: list[Request] = []
        cut_short: list[Request] = []
        for request in self.live_requests:
            deadline = request.deadline
            if deadline is None or now < deadline:
                continue
            started = request.status is RequestStatus.RUNNING or request.num_output_tokens > 0
            self._finish(request, FinishReason.TIMEOUT)
            (cut_short if started else never_started).append(request)
        return never_started, cut_short

    # --- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        trace = StepTrace(step=self.step_count)
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        if self.config.batching == "static":
            budget = self._schedule_running(chunks, trace, budget)
            self._admit_static_batch(chunks, trace, budget)
        elif not self._start_under_share_first(chunks, trace, budget):
            left_out = self.fair_share.rows_left_out(
                self.running, self.config.max_num_seqs,
                self.config.fair_step_rows or self.config.max_num_seqs)
            budget = self._schedule_running(chunks, trace, budget, left_out)
            self._admit_waiting(chunks, trace, budget)
        for chunk in chunks:
            trace.scheduled[chunk.request.request_id] = chunk.num_tokens
            chunk.request.last_step = self.step_count
        return SchedulerOutput(chunks, trace)

    def _start_under_share_first(self, chunks: list[ScheduledChunk], trace: StepTrace,
                                 budget: int) -> bool:
        """A step of its own for the waiting requests of tenants under their share of the
        seats while another tenant holds more than its share; True when one started."""
        if not self.fair_share.tenants_to_start_first(self.running, self.config.max_num_seqs):
            return False
        self._admit_waiting(chunks, trace, budget, under_share_only=True)
        if not chunks:
            return False
        started = {id(chunk.request) for chunk in chunks}
        for request in self.running:
            if id(request) not in started:
                trace.waited[request.request_id] = WaitReason.FAIR_STEP
        return True

    def _chunk_size(self, request: Request, budget: int) -> int:
        return self._fit(request.num_uncomputed_tokens, budget)

    def _fit(self, wanted: int, budget: int) -> int:
        """Tokens of `wanted` that run this step: all, a chunk, or none."""
        if wanted <= budget:
            return wanted
        return budget if self.config.enable_chunked_prefill else 0

    def _schedule_running(self, chunks: list[ScheduledChunk], trace: StepTrace,
                          budget: int, left_out: set[int] = frozenset()) -> int:
        index = 0
        while index < len(self.running):
            request = self.running[index]
            if id(request) in left_out:
                trace.waited[request.request_id] = WaitReason.FAIR_STEP
                index += 1
                continue
            num_tokens = self._chunk_size(request, budget)
            if num_tokens == 0:
                trace.waited[request.request_id] = WaitReason.NO_BUDGET
                index += 1
                continue
            target = request.num_computed_tokens + num_tokens
            while not self.block_manager.can_allocate(request, target):
                victim = self.fair_share.pick_victim(self.running)
                victim_index = self.running.index(victim)
                if victim_index < index:  # scheduled earlier in this step: take its chunk back
                    budget += self._unschedule(victim, chunks)
                    index -= 1
                self._preempt(victim, trace)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue  # it preempted itself: the next one now stands at `index`
            spare = budget - num_tokens - (len(self.running) - index - 1)
            drafts = self._drafts_that_fit(request, num_tokens, spare)
            self.block_manager.allocate(request, target + len(drafts))
            chunks.append(ScheduledChunk(request, num_tokens + len(drafts), drafts))
            budget -= num_tokens + len(drafts)
            index += 1
        return budget

    @staticmethod
    def _unschedule(request: Request, chunks: list[ScheduledChunk]) -> int:
        """Removes `request`'s chunk of this step, if it got one; returns its tokens to the
        budget."""
        chunk = next((chunk for chunk in chunks if chunk.request is request), None)
        if chunk is None:  # it had waited for budget (a whole prompt, chunking off)
            return 0
        chunks.remove(chunk)
        return chunk.num_tokens

    def _drafts_that_fit(self, request: Request, num_tokens: int, spare: int) -> list[int]:
        """A decode's drafts ride along where `spare` budget (a token kept for each running
        request after it) and free blocks allow; they never preempt anyone."""
        drafts = request.draft_token_ids[:max(spare, 0)]
        if drafts and num_tokens == request.num_uncomputed_tokens == 1 and \
                self.block_manager.can_allocate(request, request.num_tokens + len(drafts)):
            return drafts
        return []

    def _preempt(self, request: Request, trace: StepTrace) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.draft_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        trace.preempted.append(request.request_id)
        self.fair_share.requeued(request)
        self._enqueue(request)

    def _admit_waiting(self, chunks: list[ScheduledChunk], trace: StepTrace,
                       budget: int, under_share_only: bool = False) -> None:
        reason = WaitReason.PREEMPTION if trace.preempted else None
        while self.waiting and reason is None:
            waiting = self._waiting_under_share() if under_share_only else self.waiting
            if not waiting:
                reason = WaitReason.FAIR_STEP
                break
            request = self.fair_share.pick_waiting(waiting, self.running,
                                                   self.config.max_num_seqs)
            prefix = self.block_manager.cached_prefix(request)
            reason = self._why_not_admit(request, prefix, budget)
            victim = None if reason != WaitReason.NO_SEAT else self.fair_share.seat_for(
                request, self.running, self.config.max_num_seqs)
            if victim is not None:  # a tenant under its share takes a seat from one over
                budget += self._unschedule(victim, chunks)
                self._preempt(victim, trace)
                prefix = self.block_manager.cached_prefix(request)
                reason = self._why_not_admit(request, prefix, budget)
            if reason is None:
                self._admit(request, prefix)
                num_tokens = self._chunk_size(request, budget)
                self.block_manager.allocate(request, request.num_computed_tokens + num_tokens)
                chunks.append(ScheduledChunk(request, num_tokens))
                budget -= num_tokens
        for request in self.waiting:
            trace.waited[request.request_id] = reason

    def _waiting_under_share(self) -> list[Request]:
        tenants = self.fair_share.tenants_to_start_first(self.running, self.config.max_num_seqs)
        return [request for request in self.waiting if request.tenant in tenants]

    def _why_not_admit(self, request: Request, prefix: CachedPrefix,
                       budget: int) -> str | None:
        if len(self.running) >= self.config.max_num_seqs:
            return WaitReason.NO_SEAT
        if self.block_manager.next_block_inflight(request, prefix.num_blocks):
            return WaitReason.PREFIX_PENDING
        cached_tokens = prefix.num_blocks * self.block_manager.block_size
        num_tokens = self._fit(request.num_tokens - cached_tokens, budget)
        if num_tokens == 0:
            return WaitReason.NO_BUDGET
        if not self.block_manager.can_allocate(request, cached_tokens + num_tokens, prefix):
            return WaitReason.NO_BLOCKS
        return None

    def _admit(self, request: Request, prefix: CachedPrefix) -> None:
        self.waiting.remove(request)
        self.fair_share.left_queue(request)
        self.block_manager.take_prefix(request, prefix)
        if request.num_preemptions == 0:
            request.num_cached_tokens = request.num_computed_tokens
            request.queue_time_s = time.monotonic() - request.queued_at
            self.fair_share.charge_prefill(request, request.num_tokens - request.num_cached_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _admit_static_batch(self, chunks: list[ScheduledChunk], trace: StepTrace,
                            budget: int) -> None:
        """Static batching: a new batch forms only once the previous one has fully finished."""
        if self.running or trace.preempted:
            for request in self.waiting:
                trace.waited[request.request_id] = WaitReason.BATCH_CLOSED
            return
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.fair_share.pick_waiting(self.waiting, self.running,
                                                   self.config.max_num_seqs)
            prefix = self.block_manager.cached_prefix(request)
            if not self.block_manager.can_allocate(request, request.num_tokens, prefix):
                break
            self._admit(request, prefix)
            self.block_manager.allocate(request, request.num_tokens)
        # The batch's prompts then prefill under the token budget like any running request.
        self._schedule_running(chunks, trace, budget)
        for request in self.waiting:
            trace.waited[request.request_id] = WaitReason.BATCH_CLOSED

    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Apply a step's results: each sampling request's new tokens (its accepted drafts,
        then the token its step sampled), cut in place where the request stops. Returns the
        requests that finished in it."""
        finished = []
        for chunk in output.chunks:
            request = chunk.request
            if request.is_finished:
                continue  # aborted while the step ran
            tokens = sampled.get(request.request_id, [])
            # Accepted drafts have their K/V now; a rejected one's slot is written over later.
            request.num_computed_tokens += chunk.num_known_tokens + max(len(tokens) - 1, 0)
            reason = None
            for taken, token_id in enumerate(tokens, start=1):
                request.append_token(token_id)
                reason = request.check_stop(self.eos_token_ids, self.max_model_len)
                if reason is not None:
                    del tokens[taken:]
                    break
            self.fair_share.charge_decode(request, len(tokens))
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
            self.block_manager.commit(request)
            if reason is not None:
                self._finish(request, reason)
                finished.append(request)
                output.trace.finished.append(request.request_id)
            elif chunk.draft_token_ids:
                self.block_manager.release_beyond(request, request.num_tokens)
        return finished
