"""EngineCore: scheduler + block manager + model runner + sampler, driven one step at a time.

No sockets here: the engine process (engine/server.py), the offline benchmark and the
engine tests all drive this same object.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from common.config import DEFAULT_CUDA_KV_CACHE_FRACTION, EngineConfig
from common.protocol import (
    AddRequest,
    Ready,
    RequestError,
    RequestOutput,
    StepOutputs,
    StepStats,
)
from engine.attention.forward_context import StepGaveWay
from engine.attention.quantized_kv import cache_dtype, describe
from engine.block_manager import BlockManager
from engine.distributed.tensor_parallel import broadcast_int, start_worker_ranks
from engine.executor.cuda_graphs import (
    CudaGraphRecorder,
    Recorder,
    default_recorder,
    graph_memory,
)
from engine.executor.model_runner import ModelRunner, kv_bytes_per_block
from engine.give_way import may_give_way
from engine.kv_cache_groups import KVCacheLayout
from engine.kv_offload.tier import attach_disk_tier
from engine.kv_transfer import attach_kv_transfer
from engine.platform.cpu import choose_dtype
from engine.platform.machine import Machine, rss_text, take_machine_defaults
from engine.pooling.pooler import Pooler, PoolSpan
from engine.quantization.registry import quantization_summary
from engine.request import Request, deadline_passed
from engine.sampling.grammar import GrammarCompiler
from engine.sampling.grammar_waitlist import AwaitingGrammar, GrammarWaitlist
from engine.sampling.sampler import Sampler
from engine.scheduler import RequestRefused, ScheduledChunk, Scheduler, StepTrace
from engine.speculative.draft_model import DraftModel
from engine.speculative.speculator import Speculator
from engine.speculative.verify import drafted_rows, split_samples
from engine.weights.loader import load_model, weight_bytes

logger = logging.getLogger("loom.engine")


def choose_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass(slots=True)
class EngineTotals:
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0


class EngineCore:
    def __init__(self, config: EngineConfig, record_traces: bool = False,
                 recorder: Recorder | Literal["auto"] | None = "auto",
                 log_level: str = "INFO") -> None:
        """`recorder`: how decode graphs are recorded; "auto" records CUDA graphs on a GPU
        unless --enforce-eager (tests on the CPU pass engine.executor.cuda_graphs.EagerReplay).
        With --tensor-parallel-size N this process is rank 0 and starts ranks 1..N-1."""
        self.device = choose_device(config.device)
        self.machine = Machine.detect()
        self.config = config = take_machine_defaults(config, self.machine, self.device)
        self.dtype = choose_dtype(config.dtype, self.device)
        self.cache_dtype = cache_dtype(config.kv_cache_dtype, self.dtype)
        torch.manual_seed(config.seed)
        self.workers = start_worker_ranks(config, self.device, log_level)
        self.model = load_model(config.model, self.dtype, self.device,
                                quantization=config.quantization,
                                group_size=config.quantization_group_size)
        logger.info("weights: %.1f MiB (%s, %s); engine RSS %s", weight_bytes(self.model) / 2**20,
                    self.dtype, quantization_summary(self.model), rss_text())
        model_config = self.model.config
        self.model_name = config.served_model_name or config.model.rstrip("/").split("/")[-1]
        limit = model_config.max_exact_len
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self.kv_layout = KVCacheLayout.for_model(model_config,
                                                 not config.disable_hybrid_kv_cache_manager)
        if recorder == "auto":
            recorder = default_recorder(self.device, self.config, self.model.config.head_dim,
                                        self.cache_dtype)
        self.recorder = recorder
        self.draft_model = DraftModel.for_config(config, self.kv_layout, model_config.vocab_size,
                                                 self.dtype, self.device)
        num_blocks = self._num_kv_blocks()
        if self.workers is not None:
            broadcast_int(num_blocks)  # every rank holds as many blocks, for its heads
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          config.enable_prefix_caching, self.kv_layout.groups)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len,
                                   self.eos_token_ids)
        self.runner = self._make_runner(num_blocks, self.recorder)
        kv_meaning = self.runner.kv_meaning
        self.disk_tier = attach_disk_tier(config, self.block_manager, self.runner.kv_caches,
                                          self.dtype, kv_meaning)
        self.kv_transfer = attach_kv_transfer(config, self.block_manager, self.runner.kv_caches,
                                              self.dtype, kv_meaning, self.draft_model is not None)
        logger.info("%s", self.runner.kernels.describe())  # once: not for the graph probe
        self.sampler = Sampler(self.device, config.seed)
        if self.draft_model is not None:
            self.draft_model.start(num_blocks, config.block_size, self.max_model_len,
                                   config.max_num_seqs)
        self.speculator = None if config.speculative is None else Speculator(
            config.speculative, self.max_model_len, self.draft_model)
        self.pooler = Pooler()
        self.grammars = GrammarCompiler(config.model, model_config.vocab_size, self.eos_token_ids)
        self.grammar_waitlist = GrammarWaitlist(self.grammars, config.grammar_compile_timeout)
        self.step_threads = torch.get_num_threads()
        self.totals = EngineTotals()
        self.start_time = time.time()
        self.record_traces = record_traces
        self.traces: list[StepTrace] = []
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB, %d blocks per GiB, %s; %s) = "
                    "%d tokens at most in flight in global layers; max model len %d",
                    num_blocks, config.block_size, num_blocks * self._bytes_per_block / 2**30,
                    2**30 // self._bytes_per_block,
                    describe(self.cache_dtype, model_config.head_dim, self.dtype),
                    self.kv_layout.describe(), self._max_tokens_in_flight(num_blocks),
                    self.max_model_len)

    @property
    def _bytes_per_block(self) -> int:
        """Every layer's K and V of one block (a draft model's layers too)."""
        model_config = self.model.config
        draft = 0 if self.draft_model is None else self.draft_model.bytes_per_block(
            self.config.block_size)
        return draft + kv_bytes_per_block(self.kv_layout.group_size,
                                          self.model.num_local_kv_heads, model_config.head_dim,
                                          self.config.block_size, self.cache_dtype)

    def _max_tokens_in_flight(self, num_blocks: int) -> int:
        """Tokens the cache holds when it holds long requests only: blocks shared among the
        global layers' groups (sliding ones hold a window each, left out)."""
        groups = self.kv_layout.windows
        return num_blocks * self.config.block_size // (groups.count(None) or len(groups))

    def check_ranks(self) -> None:
        """Raises RankDied when a tensor-parallel rank has exited."""
        if self.workers is not None:
            self.workers.check()

    def shutdown(self) -> None:
        if self.disk_tier is not None:
            self.disk_tier.close()  # the blocks still queued reach the disk
        if self.workers is not None:
            self.workers.stop()
            self.workers = None

    def _make_runner(self, num_blocks: int, recorder: Recorder | None) -> ModelRunner:
        return ModelRunner(self.model, num_blocks, self.config.block_size, self.device,
                           self.dtype, compiled=self.config.compiled, recorder=recorder,
                           max_model_len=self.max_model_len,
                           max_num_seqs=self.config.max_num_seqs,
                           tensor_parallel=self.workers is not None, layout=self.kv_layout,
                           batch_invariant=self.config.batch_invariant,
                           cache_dtype=self.cache_dtype,
                           decode_tapes=not self.config.enforce_eager,
                           max_drafts=self.config.max_drafts)

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        budget = self.config.kv_cache_memory
        if budget is None and self.device.type == "cuda":
            graph_bytes = 0 if self.recorder is None else graph_memory(
                lambda: self._make_runner(1, CudaGraphRecorder(self.device)), self.device)
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * DEFAULT_CUDA_KV_CACHE_FRACTION) - graph_bytes
        if budget is None:  # the machine's share, never more than every seat's whole context
            seats = self.config.max_num_seqs * -(-self.max_model_len // self.config.block_size)
            budget = min(self.machine.kv_cache_bytes, seats * self._bytes_per_block)
        num_blocks = budget // self._bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory of {budget} bytes holds no block "
                             f"({self._bytes_per_block} bytes each)")
        return num_blocks

    @property
    def ready_message(self) -> Ready:
        return Ready(
            model_name=self.model_name,
            max_model_len=self.max_model_len,
            num_kv_blocks=self.block_manager.num_blocks,
            block_size=self.config.block_size,
            eos_token_ids=sorted(self.eos_token_ids),
            vocab_size=self.model.config.vocab_size,
            priority_scheduling=self.config.scheduling_policy == "priority",
        )

    # --- requests ------------------------------------------------------------------------
    def add_request(self, message: AddRequest) -> None:
        """Raises RequestRefused when the request can never be served. A constrained request
        waits outside the scheduler (no seat, no KV block) until its grammar is built."""
        request = Request(message.request_id, message.prompt_token_ids, message.sampling,
                          message.arrival_time, message.priority, message.tenant,
                          message.tenant_weight, message.timeout_s)
        if request.request_id in self.grammar_waitlist:
            raise RequestRefused(f"request id {request.request_id!r} is already in use")
        if message.output_token_ids:
            if request.sampling.grammars or request.sampling.pooling:
                raise RequestRefused("a constrained or pooling request cannot continue from "
                                     "tokens generated elsewhere")
            for token_id in message.output_token_ids:
                request.append_token(token_id)
        if not request.sampling.grammars:
            self.scheduler.add(request)
            self.kv_transfer.add(request, message)
            return
        self.scheduler.check_new(request)
        self.grammar_waitlist.add(request)

    def admit_constrained(self) -> list[RequestError]:
        """Moves each request whose grammar is built into the scheduler, with its own matcher;
        fails those whose grammar errs or outlasts --grammar-compile-timeout."""
        built, failed = self.grammar_waitlist.take_built()
        errors = [RequestError(request_id, reason) for request_id, reason in failed.items()]
        for request in built:
            try:
                self.scheduler.add(request)
            except RequestRefused as exc:
                errors.append(RequestError(request.request_id, str(exc)))
        for error in errors:
            logger.info("refused %s: %s", error.request_id, error.reason)
        return errors

    def expire_deadlines(self) -> tuple[list[RequestError], StepOutputs | None]:
        """Ends the requests whose deadline passed: an error for each that never started,
        and a frame that finishes the others (reason TIMEOUT) with what they generated."""
        never_started, cut_short = self.scheduler.expire(time.monotonic())
        for request in never_started + cut_short:
            self._forget(request)
        errors = [RequestError(request.request_id, deadline_passed(request),
                               RequestError.DEADLINE_EXCEEDED) for request in never_started]
        if not cut_short:
            return errors, None
        frame = self.idle_outputs()
        frame.outputs = [RequestOutput(request.request_id, [], request.finish_reason,
                                       request.num_cached_tokens) for request in cut_short]
        return errors, frame

    def abort_requests(self, request_ids: list[str]) -> None:
        self.grammar_waitlist.abort(request_ids)
        for request in self.scheduler.abort(request_ids):
            self._forget(request)
        for request_id in request_ids:  # also a decode leg that never came
            self.kv_transfer.aborted(request_id)

    @property
    def awaiting_grammar(self) -> dict[str, AwaitingGrammar]:
        return self.grammar_waitlist.waiting

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_awaiting_grammar(self) -> int:
        return len(self.awaiting_grammar)

    # --- one step ------------------------------------------------------------------------
    def _share_cores_with_grammar_builds(self) -> None:
        """One thread fewer while a grammar builds; never in batch-invariant mode, where the
        thread count is part of a row's numerics (fp32 GEMMs split their sums by it)."""
        threads = self.step_threads
        if self.grammars.num_building and threads > 1 and self.device.type == "cpu" \
                and not self.config.batch_invariant:
            threads -= 1
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def step(self, give_way: Callable[[], bool] | None = None) -> StepOutputs | None:
        """One step; None where `give_way` stopped it midway (engine.give_way)."""
        started = time.perf_counter()
        self.check_ranks()  # a step with a dead rank would wait on it
        self._share_cores_with_grammar_builds()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.scheduler.step_count + 1)
        scheduled = self.scheduler.schedule()
        if self.speculator is not None:
            self.speculator.fill(scheduled.chunks)
        recordings = self.runner.num_recordings
        requests: list[Request] = []
        drafts: list[list[int]] = []
        tokens: list[list[int]] = []
        logprobs: list = []
        if not scheduled.is_empty:
            try:
                sampling_chunks, logits, pooled = self._execute(
                    scheduled.chunks, give_way if may_give_way(scheduled, self.scheduler) else None)
            except StepGaveWay:
                return None
            self.pooler.add(pooled)
            requests = [chunk.request for chunk in sampling_chunks]
            drafts = [chunk.draft_token_ids for chunk in sampling_chunks]
            if requests:  # a step of prefill chunks only samples nothing
                result = self.sampler.sample(logits, drafted_rows(requests, drafts),
                                             self.eos_token_ids)
                tokens, logprobs = split_samples(result.token_ids, result.logprobs, drafts)
        embeddings = self.pooler.embeddings(requests)  # before update forgets them
        num_prompt_tokens = sum(chunk.num_known_tokens for chunk in scheduled.chunks
                                if not chunk.is_decode)
        finished = self.scheduler.update(scheduled, dict(zip(
            (r.request_id for r in requests), tokens, strict=True)))  # cut where they stop
        self._after_verification(requests, drafts, tokens, finished)
        outputs = [
            RequestOutput(r.request_id, new_tokens, r.finish_reason, r.num_cached_tokens,
                          None if token_logprobs is None else token_logprobs[:len(new_tokens)],
                          r.queue_time_s if r.num_output_tokens == len(new_tokens) else None,
                          embeddings.get(r.request_id))
            for r, new_tokens, token_logprobs in zip(requests, tokens, logprobs, strict=True)
        ]
        num_generated = sum(map(len, tokens))
        self._record(scheduled.trace, num_prompt_tokens, num_generated)
        step_time = time.perf_counter() - started
        # A step that recorded a tape (~30x a replay) says nothing of what its rows cost.
        if self.speculator is not None and num_prompt_tokens == 0 and not scheduled.is_empty \
                and self.runner.num_recordings == recordings:
            self.speculator.observe_step(scheduled.num_scheduled_tokens, step_time)
        stats = self._stats(num_prompt_tokens, num_generated, step_time)
        return StepOutputs(step=scheduled.trace.step, outputs=outputs, stats=stats)

    def _after_verification(self, requests: list[Request], drafts: list[list[int]],
                            tokens: list[list[int]], finished: list[Request]) -> None:
        if self.speculator is not None:
            self.speculator.record_step(requests, drafts, tokens)
        for request in finished:
            self._forget(request)

    def _forget(self, request: Request) -> None:
        self.pooler.forget(request.request_id)
        self.kv_transfer.finished(request.request_id)
        if self.speculator is not None:
            self.speculator.finished(request)

    def _execute(self, chunks: list[ScheduledChunk], give_way: Callable[[], bool] | None,
                 ) -> tuple[list[ScheduledChunk], torch.Tensor, list[PoolSpan]]:
        samplers = [chunk.request for chunk in chunks if chunk.completes_sequence]
        try:
            return self.runner.execute(chunks, not self.sampler.takes_raw_logits(samplers),
                                       give_way)
        except RuntimeError as error:
            if self.workers is not None:
                self.workers.explain(error)  # RankDied when a tensor-parallel rank is gone
            raise

    def _record(self, trace: StepTrace, num_prompt_tokens: int, num_generated: int) -> None:
        self.totals.num_steps += 1
        self.totals.num_prompt_tokens += num_prompt_tokens
        self.totals.num_generation_tokens += num_generated
        if self.record_traces:
            self.traces.append(trace)
        logger.debug("step %d ran %s waited %s preempted %s finished %s", trace.step,
                     trace.scheduled, trace.waited, trace.preempted, trace.finished)

    def idle_outputs(self) -> StepOutputs:
        """A frame with no tokens whose stats show the engine at rest (after aborts, say)."""
        return StepOutputs(step=self.scheduler.step_count, outputs=[], stats=self._stats(0, 0, 0.0))

    def _stats(self, num_prompt_tokens: int, num_generated: int, step_time: float) -> StepStats:
        return StepStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.awaiting_grammar),
            kv_cache_usage=self.block_manager.usage,
            num_preemptions_total=self.scheduler.num_preemptions,
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=num_generated,
            step_time_s=step_time,
            prefix_cache_queries_total=self.block_manager.stats.queries,
            prefix_cache_hits_total=self.block_manager.stats.hits,
            kv_integrity_violations_total=self.block_manager.num_integrity_violations,
            prefix_cache_disk_hits_total=self.block_manager.stats.disk_hits,
            prefix_cache_transfer_hits_total=self.block_manager.stats.transfer_hits,
            engine_start_time=self.start_time,
            **({} if self.disk_tier is None else self.disk_tier.as_stats()),
            **({} if self.speculator is None else self.speculator.totals.as_stats()),
        )

    def check_integrity(self) -> list[str]:
        problems = self.block_manager.check_integrity(self.scheduler.live_requests)
        for problem in problems:
            logger.error("KV integrity violation: %s", problem)
        return problems
