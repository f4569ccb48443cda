"""Per-request edits of a step's logits before sampling, batched over all sampling rows:
min_tokens stop suppression, repetition / presence / frequency penalties, logit_bias, and
last the grammar mask of constrained requests (engine.sampling.grammar)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from engine.platform.host_copy import device_tensor, int_tensor
from engine.request import Request
from engine.sampling.grammar import mask_logits


def process_logits(logits: torch.Tensor, requests: list[Request],
                   eos_token_ids: frozenset[int]) -> torch.Tensor:
    """Returns edited logits (a new tensor when anything applies; the input is left intact)."""
    edited = logits
    if any(needs_penalties(r) for r in requests):
        edited = apply_penalties(edited.clone(), requests)
    if any(r.sampling.logit_bias for r in requests):
        edited = apply_logit_bias(edited if edited is not logits else logits.clone(), requests)
    stop_rows, stop_columns = early_stop_positions(requests, eos_token_ids)
    if stop_rows:
        edited = edited if edited is not logits else logits.clone()
        edited[stop_rows, stop_columns] = float("-inf")
    if any(r.constraint is not None for r in requests):
        edited = mask_logits(edited if edited is not logits else logits.clone(),
                             [r.constraint for r in requests])
    return edited


def edits_logits(request: Request) -> bool:
    """Whether process_logits changes this request's row."""
    sampling = request.sampling
    return (needs_penalties(request) or bool(sampling.logit_bias)
            or request.num_output_tokens < sampling.min_tokens or request.constraint is not None)


def needs_penalties(request: Request) -> bool:
    sampling = request.sampling
    return (sampling.repetition_penalty != 1.0 or sampling.presence_penalty != 0.0
            or sampling.frequency_penalty != 0.0)


def early_stop_positions(requests: list[Request],
                         eos_token_ids: frozenset[int]) -> tuple[list[int], list[int]]:
    """min_tokens: EOS and stop tokens cannot be sampled before the minimum is reached."""
    rows: list[int] = []
    columns: list[int] = []
    for row, request in enumerate(requests):
        sampling = request.sampling
        if request.num_output_tokens >= sampling.min_tokens:
            continue
        stops = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stops |= eos_token_ids
        rows.extend([row] * len(stops))
        columns.extend(stops)
    return rows, columns


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """In place, as vLLM and the OpenAI API define them:
    repetition (prompt and output tokens): positive logits divided by p, negative multiplied;
    frequency and presence (output tokens only): logit -= f * count + p * (count > 0).
    Only the logits of tokens a request has seen are touched: O(seen), not O(vocab), and the
    token ids reach torch as one list per kind (no Python loop over them)."""
    repeated, penalized = RowTokens(), RowTokens()
    for row, request in enumerate(requests):
        sampling = request.sampling
        counts = request.output_token_counts
        if sampling.repetition_penalty != 1.0:
            repeated.add(row, [*request.prompt_token_ids, *counts],
                         [sampling.repetition_penalty])
        if counts and (sampling.frequency_penalty != 0.0 or sampling.presence_penalty != 0.0):
            penalized.add(row, list(counts), [sampling.frequency_penalty,
                                              sampling.presence_penalty], counts.values())
    flat = logits.view(-1)
    if repeated.rows:
        # A token in both prompt and output is written twice, with the same value: every
        # position's value is gathered before any is written.
        index, _, (penalty,) = repeated.tensors(logits)
        values = flat[index]
        flat[index] = torch.where(values > 0, values / penalty, values * penalty)
    if penalized.rows:
        index, count, (frequency, presence) = penalized.tensors(logits)
        flat[index] -= frequency * count + presence
    return logits


@dataclass(slots=True)
class RowTokens:
    """Several rows' token ids (with counts) and each row's parameters, gathered as lists and
    handed to torch at once."""

    rows: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    params: list[list[float]] = field(default_factory=list)

    def add(self, row: int, ids: list[int], params: list[float],
            counts: Iterable[int] = ()) -> None:
        self.rows.append(row)
        self.lengths.append(len(ids))
        self.ids += ids
        self.counts += counts
        self.params.append(params)

    def tensors(self, logits: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """(each token's flat position in `logits`, its count, and its row's parameters one
        tensor each), on the logits' device, values in their dtype."""
        device, dtype = logits.device, logits.dtype
        lengths = torch.tensor(self.lengths)
        rows = torch.repeat_interleave(torch.tensor(self.rows), lengths)
        index = rows * logits.shape[-1] + torch.tensor(self.ids, dtype=torch.int64)
        params = torch.repeat_interleave(torch.tensor(self.params, dtype=dtype), lengths, dim=0)
        counts = torch.tensor(self.counts, dtype=dtype)
        return index.to(device), counts.to(device), [p.to(device) for p in params.unbind(1)]


def apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    rows, columns, values = [], [], []
    for row, request in enumerate(requests):
        for token_id, bias in request.sampling.logit_bias.items():
            if 0 <= token_id < logits.shape[-1]:
                rows.append(row)
                columns.append(token_id)
                values.append(bias)
    device = logits.device
    index = (int_tensor(rows, device), int_tensor(columns, device))
    logits.index_put_(index, device_tensor(values, logits.dtype, device),
                      accumulate=True)
    return logits
