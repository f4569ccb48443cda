"""Batched sampling for one engine step: one row of logits per request that samples this step."""

from __future__ import annotations

import torch

from engine.request import Request


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
               eos_token_ids: frozenset[int]) -> list[int]:
        """logits: float32 [len(requests), vocab]. Returns one token id per request."""
        logits = self._suppress_early_stops(logits, requests, eos_token_ids)
        greedy = [request.sampling.greedy for request in requests]
        if all(greedy):
            return logits.argmax(dim=-1).tolist()
        probs = self._filtered_probs(logits, requests)
        noise = torch.empty_like(probs)
        for row, request in enumerate(requests):
            noise[row].exponential_(generator=self._generator_for(request))
        sampled = (probs / noise).argmax(dim=-1)
        if any(greedy):
            greedy_rows = torch.tensor(greedy, device=logits.device)
            sampled = torch.where(greedy_rows, logits.argmax(dim=-1), sampled)
        return sampled.tolist()

    @staticmethod
    def _suppress_early_stops(logits: torch.Tensor, requests: list[Request],
                              eos_token_ids: frozenset[int]) -> torch.Tensor:
        """min_tokens: EOS and stop tokens cannot be sampled before the minimum is reached."""
        rows, columns = [], []
        for row, request in enumerate(requests):
            sampling = request.sampling
            if request.num_output_tokens >= sampling.min_tokens:
                continue
            stops = set(sampling.stop_token_ids)
            if not sampling.ignore_eos:
                stops |= eos_token_ids
            rows.extend([row] * len(stops))
            columns.extend(stops)
        if rows:
            logits = logits.clone()
            logits[rows, columns] = float("-inf")
        return logits

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
