"""Drafts for the running requests each step, and when to stop drafting.

Per request, acceptance is modelled as geometric: each draft position is accepted with
probability q (estimated from its recent verifications, older ones weighing less). A k-th
draft is worth its row when q^k, the chance it is reached and accepted, exceeds what a row
costs (engine.speculative.cost): so k shrinks as q falls or the batch grows, and a request
whose q no longer pays a first draft stops drafting, trying one draft again after a pause
that doubles each time it still does not pay."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from common.speculative import SpeculativeConfig
from engine.request import Request
from engine.speculative.cost import StepCost
from engine.speculative.ngram import NgramProposer
from engine.speculative.suffix import SuffixProposer

ACCEPTANCE_DECAY = 0.8  # per verification
PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 2.0  # verifications' worth
FIRST_PAUSE, LONGEST_PAUSE = 4, 256  # steps without drafts before one is tried again


class DraftSource(Protocol):
    def propose(self, request: Request, max_drafts: int) -> list[int]: ...

    def finished(self, request: Request) -> None: ...


@dataclass(slots=True)
class Acceptance:
    accepted: float = PRIOR_ACCEPTANCE * PRIOR_WEIGHT  # decayed counts of draft positions
    decided: float = PRIOR_WEIGHT
    paused_until: int = 0  # step
    pause: int = FIRST_PAUSE

    @property
    def rate(self) -> float:
        return self.accepted / self.decided

    def record(self, num_drafts: int, num_accepted: int) -> None:
        rejected = 1 if num_accepted < num_drafts else 0  # positions after it were not tried
        self.accepted = self.accepted * ACCEPTANCE_DECAY + num_accepted
        self.decided = self.decided * ACCEPTANCE_DECAY + num_accepted + rejected

    def drafts_worth(self, row_cost: float, max_drafts: int, step: int) -> int:
        k, reach = 0, self.rate
        while k < max_drafts and reach > row_cost:
            k, reach = k + 1, reach * self.rate
        if k:
            self.pause = FIRST_PAUSE
            return k
        if step < self.paused_until:
            return 0
        self.paused_until = step + self.pause  # try one, then wait longer before the next
        self.pause = min(2 * self.pause, LONGEST_PAUSE)
        return min(1, max_drafts)


@dataclass(slots=True)
class SpecTotals:
    """vLLM's spec_decode counters: verifications with drafts, draft tokens, accepted ones,
    and accepted ones by position (0: the first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=list)


def draft_source(config: SpeculativeConfig) -> DraftSource:
    if config.method == "ngram":
        return NgramProposer(config.lookup_min, config.lookup_max)
    if config.method == "suffix":
        return SuffixProposer(config.suffix_decoding_max_tree_depth,
                              config.suffix_decoding_max_spec_factor,
                              config.suffix_decoding_min_token_prob,
                              config.suffix_decoding_max_cached_requests)
    raise ValueError(f"speculative method {config.method!r} has no draft source here")


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 source: DraftSource | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.source = source or draft_source(config)
        self.cost = StepCost()
        self.acceptance: dict[str, Acceptance] = {}
        self.totals = SpecTotals(accepted_by_position=[0] * config.max_drafts)

    def propose(self, running: list[Request], step: int) -> None:
        """Sets each running request's `draft_token_ids` for this step (none while it
        prefills, and none where drafting does not pay)."""
        decoding = [r for r in running if r.num_output_tokens and r.num_uncomputed_tokens == 1]
        for request in running:
            request.draft_token_ids = []
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return
        row_cost = self.cost.row_cost(len(decoding))
        for request in decoding:
            acceptance = self.acceptance.setdefault(request.request_id, Acceptance())
            room = min(request.sampling.max_tokens - request.num_output_tokens,
                       self.max_model_len - request.num_tokens) - 1
            wanted = min(room, self.config.max_drafts)
            if wanted > 0:
                wanted = acceptance.drafts_worth(row_cost, wanted, step)
            if wanted > 0:
                request.draft_token_ids = self._checked(request,
                                                        self.source.propose(request, wanted))

    @staticmethod
    def _checked(request: Request, drafts: list[int]) -> list[int]:
        """The drafts a constrained request's grammar allows, up to the first it forbids."""
        if request.constraint is None or not drafts:
            return drafts
        allowed = min(m.validate_tokens(drafts) for m in request.constraint.matchers)
        return drafts[:allowed]

    def record(self, request: Request, drafts: list[int], tokens: list[int]) -> None:
        """A verification: `tokens` are the accepted drafts and the row's own new token (cut
        where the request stopped)."""
        if not drafts:
            return
        accepted = min(len(tokens) - 1, len(drafts))
        totals = self.totals
        totals.num_drafts += 1
        totals.num_draft_tokens += len(drafts)
        totals.num_accepted_tokens += accepted
        for position in range(accepted):
            totals.accepted_by_position[position] += 1
        acceptance = self.acceptance.get(request.request_id)
        if acceptance is not None:
            acceptance.record(len(drafts), accepted)

    def observe_step(self, num_rows: int, seconds: float) -> None:
        """A step that ran decode and draft rows only (prompt chunks cost otherwise)."""
        self.cost.observe(num_rows, seconds)

    def finished(self, request: Request) -> None:
        self.acceptance.pop(request.request_id, None)
        self.source.finished(request)
