"""Drafts for the running requests each step, and how many of them pay.

Per request, acceptance is modelled as geometric: each draft position is accepted with
probability q (estimated from its recent verifications, older ones weighing less, and
counted one standard error low where other requests decode beside it: a draft then slows
them too), so its j-th draft yields q^j tokens on average. A draft slows the whole step but
speeds one request: each step the drafts taken, best first, are
those that maximize the sum over the decoding requests of log(expected tokens / step time)
(proportional fairness), step time by row count from engine.speculative.cost, and only if
that promises at least a 1% mean gain. So k shrinks as q falls, as the batch grows, and
where one more row costs a jump in step time. Only then is the source asked for that many.
A request none of whose drafts pay stops drafting, and tries one draft again after a
pause that doubles each time it still does not pay; beside other decoding requests, only one
its source is sure of (`sure_draft`, where the source has one): at a busy server most such
probes were rows that slowed every request and saved no step, while one stream alone
resumes drafting sooner on any match (after an edit in a quoted text, say)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from common.speculative import SpeculativeConfig
from engine.request import Request
from engine.scheduler import ScheduledChunk
from engine.speculative.cost import StepCost
from engine.speculative.ngram import NgramProposer
from engine.speculative.suffix import SuffixProposer

ACCEPTANCE_DECAY = 0.8  # per verification
PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 2.0  # verifications' worth
FIRST_PAUSE, LONGEST_PAUSE = 4, 256  # steps without drafts before one is tried again
# Drafts must promise the decoding requests at least this mean gain in log speed (1%): the
# estimates behind a smaller one are noisier than the gain.
MIN_GAIN_PER_REQUEST = 0.01
# A draft counted on for less than this gain in its request's log speed cannot pay for its
# row (every row costs at least the cost line's slope): it is not weighed at all.
NEGLIGIBLE_GAIN = 1e-3


class DraftSource(Protocol):
    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """Up to max_drafts drafts (PLACEHOLDERs where `fill` writes them later)."""
        ...

    def finished(self, request: Request) -> None: ...


def sure_draft(source: DraftSource, request: Request) -> list[int]:
    """One draft for a probe: the source's `sure_draft` (empty where it is not sure of the
    next token), else its first draft."""
    sure = getattr(source, "sure_draft", None)
    return sure(request) if sure is not None else source.propose(request, 1)


PLACEHOLDER = -1  # a draft slot reserved before a draft model fills it


@dataclass(slots=True)
class Acceptance:
    accepted: float = PRIOR_ACCEPTANCE * PRIOR_WEIGHT  # decayed counts of draft positions
    decided: float = PRIOR_WEIGHT
    paused_until: int = 0  # step
    pause: int = FIRST_PAUSE

    @property
    def rate(self) -> float:
        return self.accepted / self.decided

    @property
    def cautious_rate(self) -> float:
        """The rate less one standard error: a draft costs the whole step now, so a rate
        seen a few times counts for less than one seen many times."""
        rate = self.rate
        return max(0.0, rate - math.sqrt(rate * (1 - rate) / self.decided))

    def record(self, num_drafts: int, num_accepted: int) -> None:
        rejected = 1 if num_accepted < num_drafts else 0  # positions after it were not tried
        self.accepted = self.accepted * ACCEPTANCE_DECAY + num_accepted
        self.decided = self.decided * ACCEPTANCE_DECAY + num_accepted + rejected

    def yields(self, num_drafts: int, cautious: bool = True) -> list[float]:
        """Accepted tokens each of the first `num_drafts` draft positions is counted on to
        yield (at the cautious rate, or the rate as it stands)."""
        rate = self.cautious_rate if cautious else self.rate
        return [rate ** position for position in range(1, num_drafts + 1)]

    def probe_due(self, step: int) -> bool:
        """No draft paid this step: may one be tried anyway (then the pause doubles)?"""
        if step < self.paused_until:
            return False
        self.paused_until = step + self.pause
        self.pause = min(2 * self.pause, LONGEST_PAUSE)
        return True


@dataclass(slots=True)
class SpecTotals:
    """vLLM's spec_decode counters: verifications with drafts, draft tokens, accepted ones,
    and accepted ones by position (0: the first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=list)

    def as_stats(self) -> dict[str, int | list[int]]:
        """As common.protocol.StepStats names them."""
        return {"spec_decode_num_drafts_total": self.num_drafts,
                "spec_decode_num_draft_tokens_total": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens_total": self.num_accepted_tokens,
                "spec_decode_accepted_by_position_total": list(self.accepted_by_position)}


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
        prefills, and none where drafting does not pay). How many drafts pay is decided
        first; only then are that many asked of the source (where it has them)."""
        for request in running:
            request.draft_token_ids = []
        decoding = [r for r in running if r.num_output_tokens and r.num_uncomputed_tokens == 1]
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return
        rooms = {}
        for request in decoding:
            room = min(request.sampling.max_tokens - request.num_output_tokens,
                       self.max_model_len - request.num_tokens, self.config.max_drafts + 1) - 1
            if room > 0:
                rooms[request.request_id] = (request, room)
        taken, probes = self._worth_taking(len(decoding), rooms, step)
        alone = len(decoding) == 1  # a probe's row then slows only its own request
        for request_id, count in taken.items():
            request = rooms[request_id][0]
            if request_id in probes:
                drafts = (self.source.propose(request, 1) if alone
                          else sure_draft(self.source, request))
                request.draft_token_ids = self._checked(request, drafts)
            elif count:
                request.draft_token_ids = self._checked(
                    request, self.source.propose(request, count))

    def _worth_taking(self, num_decoding: int, rooms: dict[str, tuple[Request, int]],
                      step: int) -> tuple[dict[str, int], set[str]]:
        """How many drafts each request (up to its room) verifies: the best first, as many
        as maximize the sum over the decoding requests of log(expected tokens per second);
        and the requests due a probe (one draft, though none pays)."""
        if not rooms:
            return {}, set()
        candidates = []
        for request_id, (_, room) in rooms.items():
            acceptance = self.acceptance.get(request_id)
            if acceptance is None:
                acceptance = self.acceptance[request_id] = Acceptance()
            expected = 1.0
            for value in acceptance.yields(room, cautious=num_decoding > 1):
                gain = math.log1p(value / expected)
                if gain < NEGLIGIBLE_GAIN:
                    break
                candidates.append((gain, request_id))
                expected += value
        candidates.sort(key=lambda candidate: -candidate[0])
        times = self.cost.seconds_from(num_decoding, len(candidates) + 1)
        base = num_decoding * math.log(times[0])
        best_count, best_gain, gain = 0, MIN_GAIN_PER_REQUEST * num_decoding, 0.0
        for count, (value, _) in enumerate(candidates, start=1):
            gain += value
            net = gain - num_decoding * math.log(times[count]) + base
            if net > best_gain:
                best_count, best_gain = count, net
        taken: dict[str, int] = dict.fromkeys(rooms, 0)
        for _, request_id in candidates[:best_count]:
            taken[request_id] += 1
        # A probe adds a row; even accepted, it yields its request one token more (log 2).
        # Where the row costs the step's requests more than that, no draft of any request
        # pays at this batch either: the probes wait (still due) until the batch shrinks.
        row_cost = num_decoding * math.log(times[best_count + 1] / times[best_count])
        probing = num_decoding == 1 or row_cost < math.log(2)
        probes = set()
        for request_id, count in taken.items():
            acceptance = self.acceptance[request_id]
            if count:
                acceptance.pause = FIRST_PAUSE
            elif probing and acceptance.probe_due(step):
                probes.add(request_id)
        return taken, probes

    def fill(self, chunks: list[ScheduledChunk]) -> None:
        """After scheduling: a draft model runs over the step's chunks and writes the drafts
        in place (a grammar then cuts them where it forbids one)."""
        fill = getattr(self.source, "fill", None)
        if fill is None:
            return
        fill(chunks)
        for chunk in chunks:
            drafts = chunk.draft_token_ids
            allowed = len(self._checked(chunk.request, drafts))
            chunk.num_tokens -= len(drafts) - allowed
            del drafts[allowed:]

    @staticmethod
    def _checked(request: Request, drafts: list[int]) -> list[int]:
        """The drafts a constrained request's grammar allows, up to the first it forbids."""
        if request.constraint is None or not drafts or drafts[0] == PLACEHOLDER:
            return drafts
        allowed = min(m.validate_tokens(drafts) for m in request.constraint.matchers)
        return drafts[:allowed]

    def record_step(self, requests: list[Request], drafts: list[list[int]],
                    tokens: list[list[int]]) -> None:
        """A step's verifications, request by request (`record`)."""
        for request, drafted, new_tokens in zip(requests, drafts, tokens, strict=True):
            self.record(request, drafted, new_tokens)

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
