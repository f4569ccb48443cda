"""Per-request edits of a step's logits before sampling, batched over all sampling rows:
min_tokens stop suppression, repetition / presence / frequency penalties, logit_bias, and
last the grammar mask of constrained requests (engine.sampling.grammar)."""

from __future__ import annotations

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
    Only the logits of tokens a request has seen are touched: O(seen), not O(vocab), each
    row's token ids handed to torch as lists (no Python loop over them)."""
    vocab = logits.shape[-1]
    flat = logits.view(-1)
    seen: list[torch.Tensor] = []  # flat positions; a token in prompt and output twice
    penalties: list[torch.Tensor] = []
    output_positions: list[torch.Tensor] = []
    subtract: list[torch.Tensor] = []
    for row, request in enumerate(requests):
        sampling = request.sampling
        counts = request.output_token_counts
        outputs = torch.tensor(list(counts), dtype=torch.int64) + row * vocab
        if sampling.repetition_penalty != 1.0:
            prompt = torch.tensor(request.prompt_token_ids, dtype=torch.int64) + row * vocab
            seen += [prompt, outputs]
            penalties.append(torch.full((len(prompt) + len(outputs),),
                                        sampling.repetition_penalty))
        if counts and (sampling.frequency_penalty != 0.0 or sampling.presence_penalty != 0.0):
            output_positions.append(outputs)
            subtract.append(sampling.frequency_penalty * torch.tensor(list(counts.values()))
                            + sampling.presence_penalty)
    if seen:
        # Every write of a position writes the same value: gathered before any is written.
        index = torch.cat(seen).to(logits.device)
        values = flat[index]
        penalty = torch.cat(penalties).to(logits.dtype).to(logits.device)
        flat[index] = torch.where(values > 0, values / penalty, values * penalty)
    if output_positions:
        index = torch.cat(output_positions).to(logits.device)
        flat[index] -= torch.cat(subtract).to(logits.dtype).to(logits.device)
    return logits


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
