"""Grammars of constrained requests (`SamplingParams.grammars`): compiled off the step loop,
one `Constraint` per request (a matcher per grammar, all advanced together), one token
bitmask per constrained row of a step: the tokens every one of its grammars allows.

- `GrammarCompiler` builds llguidance matchers on one worker thread (llguidance drops the
  GIL while it builds), so a slow grammar never stalls other requests' steps. Each distinct
  grammar is built once; a request gets a copy of the built matcher. The tokenizer comes
  from the model directory, loaded once, by the first build (as vLLM starts its grammar
  backend on the first structured request): a server that never constrains its output never
  pays the ~2 s (importing transformers and llguidance's tokenizer view), and no first
  request after the start shares the GIL with that import (loaded right after READY, it
  slowed such a request's decode ~10x).
- While a build runs on a CPU engine, steps use one torch thread fewer, leaving the worker
  a core: with every core busy in a step, OpenMP waits on whichever thread the build
  preempts, and steps slow down far more than with the core left to it (bench.structured;
  figures in docs/benchmarks.md).
- A request waiting for its grammar holds no seat and no KV block (EngineCore keeps it
  outside the scheduler) and fails with a clear error when its grammar errs or its build
  runs longer than the time limit (counted from the build's start: neither the queue behind
  other builds nor loading the tokenizer counts).
- `mask_logits` sets every token a grammar forbids to -inf in the constrained rows;
  `Request.append_token` advances the constraint with each sampled token, and a grammar that
  accepts nothing more finishes the request (finish reason `stop`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy
import torch

from engine.platform.host_copy import int_tensor, upload

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
BITS = 32


class GrammarError(ValueError):
    """llguidance could not build the grammar against the tokenizer."""


@dataclass(slots=True)
class GrammarBuild:
    """One grammar's build on the worker: `future` holds the pristine matcher."""

    future: Future[Any] = field(default_factory=Future)
    started_at: float | None = None  # monotonic, once the worker begins building

    def running_for(self, now: float) -> float:
        return 0.0 if self.started_at is None or self.future.done() else now - self.started_at


class GrammarCompiler:
    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._builds: dict[str, GrammarBuild] = {}
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self.num_built = 0
        self.num_building = 0  # builds running on the worker now (read by the step loop)

    def submit(self, grammar: str) -> GrammarBuild:
        """The (pending or finished) build of `grammar`; equal grammars share one build."""
        build = self._builds.get(grammar)
        if build is None or build.future.cancelled():
            if len(self._builds) >= MAX_CACHED_GRAMMARS:
                self._builds.pop(next(iter(self._builds)))
            build = self._builds[grammar] = GrammarBuild()
            build.future = self._executor.submit(self._build, grammar, build)
        return build

    def forget(self, grammar: str) -> None:
        """Drops a build nobody waits for any more (cancelled if it has not started)."""
        build = self._builds.pop(grammar, None)
        if build is not None:
            build.future.cancel()

    def _build(self, grammar: str, build: GrammarBuild) -> Any:
        from llguidance import LLMatcher

        tokenizer = self.tokenizer()
        build.started_at = time.monotonic()
        self.num_building += 1
        try:
            matcher = LLMatcher(tokenizer, grammar)
        finally:
            self.num_building -= 1
        if matcher.is_error():  # the first line: a library panic appends its backtrace
            raise GrammarError(matcher.get_error().strip().splitlines()[0])
        self.num_built += 1
        return matcher

    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from llguidance.hf import from_tokenizer
                from transformers import AutoTokenizer

                hf_tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
                self._tokenizer = from_tokenizer(hf_tokenizer, n_vocab=self.vocab_size,
                                                 eos_token=self.eos_token_ids)
                logger.info("loaded the tokenizer for constrained decoding")
            return self._tokenizer

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


@dataclass(slots=True)
class Constraint:
    """Every grammar one request's output must match, as llguidance matchers advanced in step:
    a token is allowed when all of them allow it; the output ends when any of them is done."""

    matchers: list[Any]

    def consume_token(self, token_id: int) -> None:
        for matcher in self.matchers:
            matcher.consume_token(token_id)

    def is_stopped(self) -> bool:
        return any(matcher.is_stopped() for matcher in self.matchers)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int, scratch: torch.Tensor) -> None:
        """Row `index` of `bitmask`: the tokens all matchers allow (`scratch`: one spare row)."""
        from llguidance.torch import fill_next_token_bitmask

        first, *others = self.matchers
        fill_next_token_bitmask(first, bitmask, index)
        for matcher in others:
            fill_next_token_bitmask(matcher, scratch, 0)
            bitmask[index] &= scratch[0]


def mask_logits(logits: torch.Tensor, constraints: list[Constraint | None]) -> torch.Tensor:
    """`logits` [rows, vocab] with the tokens each row's constraint forbids at -inf (in place);
    a row whose constraint is None is left alone. The masks are added as 0 / -inf (a bool
    `masked_fill` measured several times slower; docs/benchmarks.md)."""
    rows = [row for row, constraint in enumerate(constraints) if constraint is not None]
    if not rows:
        return logits
    vocab = logits.shape[1]
    words = (vocab + BITS - 1) // BITS
    bitmask = torch.empty((len(rows), words), dtype=torch.int32)
    scratch = torch.empty((1, words), dtype=torch.int32)
    for index, row in enumerate(rows):
        constraints[row].fill_bitmask(bitmask, index, scratch)
    bits = numpy.unpackbits(bitmask.numpy().view(numpy.uint8), axis=1, bitorder="little")
    # 1 - 1/bit: 0 where allowed, -inf where not (cheaper than log or masked_fill).
    penalty = upload(torch.from_numpy(bits[:, :vocab]), logits.device).to(logits.dtype)
    penalty.reciprocal_().neg_().add_(1)
    if len(rows) == logits.shape[0]:
        return logits.add_(penalty)
    row_index = int_tensor(rows, logits.device)
    logits[row_index] += penalty
    return logits
