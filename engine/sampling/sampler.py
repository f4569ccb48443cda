"""Batched sampling for one engine step: one row of logits per request that samples this step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from engine.kernels.sampling import (
    RowFilters,
    argmax_rows,
    kernel_reads,
    load_sampling,
    sample_rows,
)
from engine.platform.host_copy import device_tensor, download, int_tensor
from engine.request import Request
from engine.sampling.logits_processors import edits_logits, process_logits

POSITION_MIX = 0x9E3779B97F4A7C15  # spreads seeds apart before a position is added
TokenLogprobs = list[Any]  # [chosen token logprob, [[top token id, logprob], ...]]


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where the request asked for none


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.default_generator = torch.Generator(device=device).manual_seed(seed)

    def _generator_for(self, request: Request) -> torch.Generator:
        """A seeded request's noise for its next output token comes from (seed, the token's
        position) alone: how its tokens were grouped into steps (drafts verified together,
        preemption) cannot change which noise a position gets."""
        seed = request.sampling.seed
        if seed is None:
            return self.default_generator
        position_seed = (seed * POSITION_MIX + request.num_output_tokens) % 2**63
        return torch.Generator(device=self.device).manual_seed(position_seed)

    @staticmethod
    def takes_raw_logits(requests: list[Request]) -> bool:
        """No row edits its logits or asks for logprobs: the sampler reads the output
        projection's own logits (no float32 copy)."""
        return all(request.sampling.logprobs is None and not edits_logits(request)
                   for request in requests)

    def sample(self, logits: torch.Tensor, requests: list[Request],
               eos_token_ids: frozenset[int]) -> SampleResult:
        """logits: raw [len(requests), vocab], float32 unless `takes_raw_logits(requests)`;
        one token id per request."""
        if not self.takes_raw_logits(requests):
            logits = logits.float()  # edits and logprobs are float32 math
        sampled = self._draw(process_logits(logits, requests, eos_token_ids), requests)
        wanted = [request.sampling.logprobs for request in requests]
        if all(n is None for n in wanted):
            token_ids, = download(sampled)
            return SampleResult(list(map(int, token_ids)), [None] * len(requests))
        rows = [row for row, n in enumerate(wanted) if n is not None]
        top_n = max(wanted[row] for row in rows)
        token_ids, *logprob_lists = download(sampled, *self._logprobs(logits, sampled, rows, top_n))
        return SampleResult(list(map(int, token_ids)),
                            self._logprob_rows(wanted, rows, top_n, *logprob_lists))

    def _draw(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Each row's token from its (edited) logits: greedy rows their first maximum, the
        others a draw. On the CPU one C++ pass over the rows as they are; elsewhere torch."""
        greedy = [request.sampling.greedy for request in requests]
        if all(greedy):
            return greedy_tokens(logits)
        if kernel_reads(logits) and (library := load_sampling()) is not None:
            return sample_rows(library, logits, self._row_filters(requests, greedy))
        logits = logits.float()
        randomly = self._sample_random(logits, requests, greedy)
        return torch.where(device_tensor(greedy, torch.bool, logits.device),
                           first_max_index(logits), randomly)

    def _row_filters(self, requests: list[Request], greedy: list[bool]) -> RowFilters:
        """The C++ sampler's per-row parameters; a uniform draw for each row that samples,
        a seeded row's from its own generator (the unseeded ones share one draw)."""
        uniforms = torch.zeros(len(requests), dtype=torch.float64)
        unseeded = [row for row, request in enumerate(requests)
                    if request.sampling.seed is None and not greedy[row]]
        if unseeded:
            uniforms[unseeded] = torch.rand(len(unseeded), dtype=torch.float64,
                                            generator=self.default_generator)
        for row, request in enumerate(requests):
            if request.sampling.seed is not None and not greedy[row]:
                uniforms[row] = torch.rand((), dtype=torch.float64,
                                           generator=self._generator_for(request))
        params = [request.sampling for request in requests]
        return RowFilters(
            temperatures=[0.0 if greedy[row] else p.temperature for row, p in enumerate(params)],
            top_ks=[p.top_k for p in params], top_ps=[p.top_p for p in params],
            min_ps=[p.min_p for p in params], uniforms=uniforms)

    def _sample_random(self, logits: torch.Tensor, requests: list[Request],
                       greedy: list[bool]) -> torch.Tensor:
        """Samples every row in torch (greedy rows are overridden by the caller). A seeded row is
        sampled alone, from its own generator: its candidates, their order and its noise
        then depend on nothing else in the batch, so its tokens are the same whatever shares
        its steps. The unseeded rows share one draw from the default generator."""
        choice = torch.zeros(len(requests), dtype=torch.int64, device=logits.device)
        unseeded = [row for row, request in enumerate(requests)
                    if request.sampling.seed is None and not greedy[row]]
        for row, request in enumerate(requests):
            if request.sampling.seed is not None and not greedy[row]:
                choice[row] = self._race(logits[row:row + 1], [request],
                                         self._generator_for(request))[0]
        if unseeded:
            index = int_tensor(unseeded, logits.device)
            choice.index_copy_(0, index, self._race(
                logits.index_select(0, index), [requests[row] for row in unseeded],
                self.default_generator))
        return choice

    def _race(self, logits: torch.Tensor, requests: list[Request],
              generator: torch.Generator) -> torch.Tensor:
        """The exponential race argmax(p / Exp(1)) over every row, its noise from
        `generator`. Candidates: the top max(k) tokens when every row has top_k (cheap), the
        whole vocabulary sorted when top_p needs it, else the whole vocabulary as it is."""
        sampling_rows = [request.sampling for request in requests]
        candidate_ids = None  # dividing by a temperature keeps the order: select first
        if all(params.top_k > 0 for params in sampling_rows):
            width = min(max(params.top_k for params in sampling_rows), logits.shape[-1])
            logits, candidate_ids = logits.topk(width, dim=-1)
        elif any(params.top_p < 1.0 or params.top_k > 0 for params in sampling_rows):
            logits, candidate_ids = logits.sort(dim=-1, descending=True)
        temperatures = device_tensor([r.sampling.temperature or 1.0 for r in requests],
                                     logits.dtype, logits.device)
        logits = logits / temperatures[:, None]
        probs = self._filter(logits, requests, is_sorted=candidate_ids is not None).softmax(-1)
        noise = torch.empty_like(probs).exponential_(generator=generator)
        choice = first_max_index(probs / noise)
        return choice if candidate_ids is None else candidate_ids.gather(1, choice[:, None])[:, 0]

    @staticmethod
    def _filter(logits: torch.Tensor, requests: list[Request], is_sorted: bool) -> torch.Tensor:
        """min_p, then top-k and top-p (which need descending order) as -inf masks."""
        device = logits.device
        min_ps = [request.sampling.min_p for request in requests]
        if any(min_ps):
            # p / p_max = exp(logit - max logit): no softmax needed for the threshold.
            floor = device_tensor([math.log(p) if p > 0 else -math.inf for p in min_ps],
                                  logits.dtype, device)
            threshold = logits.max(dim=-1, keepdim=True).values + floor[:, None]
            logits = logits.masked_fill(logits < threshold, float("-inf"))
        if not is_sorted:
            return logits
        width = logits.shape[-1]
        top_k = device_tensor([r.sampling.top_k if r.sampling.top_k > 0 else width
                               for r in requests], torch.int64, device)
        drop = torch.arange(width, device=device)[None, :] >= top_k[:, None]
        if any(r.sampling.top_p < 1.0 for r in requests):
            top_p = device_tensor([r.sampling.top_p for r in requests], logits.dtype, device)
            probs = logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the token crossing it kept).
            drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        return logits.masked_fill(drop, float("-inf"))

    @staticmethod
    def _logprobs(logits: torch.Tensor, sampled: torch.Tensor, rows: list[int], top_n: int,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probabilities of the model's own distribution (before any sampling edits),
        as vLLM reports them, for `rows`: the chosen token's [R], the top-N's [R, N] and
        their ids [R, N], on the device."""
        if len(rows) < logits.shape[0]:
            row_index = int_tensor(rows, logits.device)
            logits, sampled = logits.index_select(0, row_index), sampled.index_select(0, row_index)
        normalizer = logits.logsumexp(dim=-1, keepdim=True)  # logprob = logit - normalizer
        chosen = (logits.gather(1, sampled[:, None]) - normalizer)[:, 0]
        top_values, top_ids = logits.topk(top_n, dim=-1)
        return chosen, top_values - normalizer, top_ids

    @staticmethod
    def _logprob_rows(wanted: list[int | None], rows: list[int], top_n: int,
                      chosen: list[float], top_values: list[float], top_ids: list[float],
                      ) -> list[TokenLogprobs | None]:
        """The downloaded logprobs as each row reports them: [chosen, [[id, logprob], ...]]."""
        results: list[TokenLogprobs | None] = [None] * len(wanted)
        for position, row in enumerate(rows):
            n = wanted[row]
            start = position * top_n
            top = [[int(token_id), value] for token_id, value in
                   zip(top_ids[start:start + n], top_values[start:start + n], strict=True)]
            results[row] = [chosen[position], top]
        return results


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum: one C++ pass over the rows as they are on the CPU (bf16 or
    fp32), torch's max elsewhere."""
    if kernel_reads(logits) and (library := load_sampling()) is not None:
        return argmax_rows(library, logits)
    return first_max_index(logits)


def first_max_index(values: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim, ties to the first: `max` returns the same index and runs
    ~4x faster on the CPU over a wide vocabulary (32 x 262k: 2.3 ms against 10.4)."""
    return values.max(dim=-1).indices
