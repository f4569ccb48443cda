"""Batched sampling for one engine step: one row of logits per request that samples this step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.logits_processors import process_logits
from engine.request import Request

TokenLogprobs = list[Any]  # [chosen token logprob, [[top token id, logprob], ...]]


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where the request asked for none


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)

    def _generator_for(self, request: Request) -> torch.Generator:
        seed = request.sampling.seed
        if seed is None:
            return self.default_generator
        generator = self.request_generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            self.request_generators[request.request_id] = generator
        return generator

    def sample(self, logits: torch.Tensor, requests: list[Request],
               eos_token_ids: frozenset[int]) -> SampleResult:
        """logits: raw float32 [len(requests), vocab]; one token id per request."""
        processed = process_logits(logits, requests, eos_token_ids)
        greedy = [request.sampling.greedy for request in requests]
        if all(greedy):
            sampled = processed.argmax(dim=-1)
        else:
            probs = self._filtered_probs(processed, requests)
            noise = torch.empty_like(probs)
            for row, request in enumerate(requests):
                noise[row].exponential_(generator=self._generator_for(request))
            sampled = (probs / noise).argmax(dim=-1)
            if any(greedy):
                greedy_rows = torch.tensor(greedy, device=logits.device)
                sampled = torch.where(greedy_rows, processed.argmax(dim=-1), sampled)
        return SampleResult(sampled.tolist(), self._logprobs(logits, sampled, requests))

    @staticmethod
    def _logprobs(logits: torch.Tensor, sampled: torch.Tensor,
                  requests: list[Request]) -> list[TokenLogprobs | None]:
        """Log-probabilities of the model's own distribution (before any sampling edits),
        as vLLM reports them: the chosen token's, and the top-N."""
        wanted = [request.sampling.logprobs for request in requests]
        if all(n is None for n in wanted):
            return [None] * len(requests)
        rows = [row for row, n in enumerate(wanted) if n is not None]
        row_index = torch.tensor(rows, device=logits.device)
        logprobs = logits.index_select(0, row_index).log_softmax(dim=-1)
        chosen = logprobs.gather(1, sampled.index_select(0, row_index)[:, None])[:, 0].tolist()
        top_values, top_ids = logprobs.topk(max(wanted[row] for row in rows), dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        results: list[TokenLogprobs | None] = [None] * len(requests)
        for position, row in enumerate(rows):
            n = wanted[row]
            top = [[token_id, value] for token_id, value in
                   zip(top_ids[position][:n], top_values[position][:n], strict=True)]
            results[row] = [chosen[position], top]
        return results

    def _filtered_probs(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        temperatures = torch.tensor(
            [request.sampling.temperature or 1.0 for request in requests],
            dtype=logits.dtype, device=logits.device)
        logits = logits / temperatures[:, None]
        if any(r.sampling.top_k > 0 or r.sampling.top_p < 1.0 for r in requests):
            logits = self._apply_top_k_top_p(logits, requests)
        probs = logits.softmax(dim=-1)
        min_ps = [request.sampling.min_p for request in requests]
        if any(min_ps):
            min_p = torch.tensor(min_ps, dtype=probs.dtype, device=probs.device)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    @staticmethod
    def _apply_top_k_top_p(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        vocab = logits.shape[-1]
        top_k = torch.tensor([r.sampling.top_k if r.sampling.top_k > 0 else vocab
                              for r in requests], device=logits.device)
        top_p = torch.tensor([r.sampling.top_p for r in requests],
                             dtype=logits.dtype, device=logits.device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= top_k[:, None]
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
