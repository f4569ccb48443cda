"""Verification: a request with k drafts samples k + 1 rows of one forward, row j as the
request would stand after its first j drafts (penalties, min_tokens and grammar masks see
those drafts as output), each row sampled exactly as a step without drafts samples it.
The drafts are accepted while each equals its row's sample; the first row that differs
(or the row after the last draft) gives the step's own new token.

For a draft that is a point mass (n-gram and suffix drafts, and greedy draft-model drafts)
this is Leviathan et al.'s rejection sampling: row j's sample equals draft d with
probability p(d), the acceptance rule; otherwise it is distributed as p with d left out and
renormalized, the residual. So sampled output keeps the model's distribution, and greedy
output is the argmax chain a step-by-step decode would produce."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.sampling import SamplingParams
from engine.request import Request

if TYPE_CHECKING:
    import torch

    from engine.sampling.grammar import Constraint


@dataclass(slots=True)
class ConstraintAfter:
    """A request's grammar as it stands after `tokens` (the drafts before a row): the
    matchers consume them, give the row's mask, and roll back."""

    constraint: Constraint
    tokens: list[int]

    def fill_bitmask(self, bitmask: torch.Tensor, index: int, scratch: torch.Tensor) -> None:
        for matcher in self.constraint.matchers:
            matcher.consume_tokens(self.tokens)
        try:
            self.constraint.fill_bitmask(bitmask, index, scratch)
        finally:
            for matcher in self.constraint.matchers:
                matcher.rollback(len(self.tokens))


@dataclass(slots=True)
class DraftedRow:
    """`request` as the sampler sees it after `drafts` were appended to its output."""

    request: Request
    drafts: list[int]

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.drafts)

    @property
    def output_token_counts(self) -> Counter[int]:
        if not self.drafts:
            return self.request.output_token_counts
        return self.request.output_token_counts + Counter(self.drafts)

    @property
    def constraint(self) -> Constraint | ConstraintAfter | None:
        constraint = self.request.constraint
        if constraint is None or not self.drafts:
            return constraint
        return ConstraintAfter(constraint, self.drafts)


def drafted_rows(requests: list[Request], drafts: list[list[int]]) -> list[Any]:
    """The rows a step samples: one per request without drafts (the request itself), k + 1
    for a request with k."""
    rows: list[Any] = []
    for request, request_drafts in zip(requests, drafts, strict=True):
        if not request_drafts:
            rows.append(request)
            continue
        rows.extend(DraftedRow(request, request_drafts[:j]) for j in range(len(request_drafts) + 1))
    return rows


def accepted_tokens(drafts: list[int], samples: list[int]) -> list[int]:
    """The drafts up to the first that differs from its row's sample, then that sample."""
    accepted = 0
    while accepted < len(drafts) and samples[accepted] == drafts[accepted]:
        accepted += 1
    return samples[:accepted + 1]


def split_samples(token_ids: list[int], logprobs: list[Any], drafts: list[list[int]],
                  ) -> tuple[list[list[int]], list[list[Any] | None]]:
    """Per request (in `drafted_rows` order): its new tokens and their logprobs (None where
    it asked for none) out of the step's sampled rows."""
    tokens: list[list[int]] = []
    token_logprobs: list[list[Any] | None] = []
    start = 0
    for request_drafts in drafts:
        stop = start + len(request_drafts) + 1
        taken = accepted_tokens(request_drafts, token_ids[start:stop])
        tokens.append(taken)
        rows = logprobs[start:start + len(taken)]
        token_logprobs.append(None if rows[0] is None else rows)
        start = stop
    return tokens, token_logprobs
