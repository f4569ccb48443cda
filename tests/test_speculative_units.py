"""Speculative decoding, pure-Python tier: the config, the n-gram and suffix draft sources,
acceptance, the step-cost table, how many drafts pay, and the scheduler's draft slots."""

from __future__ import annotations

import argparse
import itertools
import random

import pytest

from common.config import EngineConfig, add_engine_args
from common.speculative import SpeculativeConfig
from engine.request import Request, RequestStatus
from engine.speculative.cost import StepCost
from engine.speculative.ngram import NgramProposer
from engine.speculative.speculator import Acceptance, Speculator
from engine.speculative.suffix import (
    FollowCounts,
    SuffixProposer,
    context_hashes,
    counted_lengths,
    window_hashes,
)
from engine.speculative.verify import DraftedRow, accepted_tokens, drafted_rows, split_samples
from tests.scheduler_helpers import make_request, make_scheduler


def decoding(request_id: str, tokens: list[int], num_prompt: int, max_tokens: int = 100,
             **sampling) -> Request:
    request = make_request(request_id, prompt=tokens[:num_prompt], max_tokens=max_tokens,
                           **sampling)
    for token in tokens[num_prompt:]:
        request.append_token(token)
    request.num_computed_tokens = request.num_tokens - 1
    request.status = RequestStatus.RUNNING
    return request


# --- config ------------------------------------------------------------------------------
def test_the_config_reads_vllms_json_and_fills_defaults():
    ngram = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, '
                                    '"prompt_lookup_max": 4}')
    assert (ngram.max_drafts, ngram.lookup_min, ngram.lookup_max) == (3, 4, 4)  # vLLM's rule
    plain = SpeculativeConfig.parse('{"method": "ngram"}')
    assert (plain.max_drafts, plain.lookup_min, plain.lookup_max) == (5, 2, 5)
    suffix = SpeculativeConfig.parse('{"method": "suffix"}')
    assert suffix.max_drafts == suffix.suffix_decoding_max_tree_depth == 24
    config = EngineConfig(model="m", speculative_config='{"method": "suffix"}')
    assert config.speculative == suffix
    assert EngineConfig.from_json(config.to_json()).speculative == suffix


@pytest.mark.parametrize(("text", "message"), [
    ("{", "not JSON"),
    ("[1]", "JSON object"),
    ('{"num_speculative_tokens": 2}', 'needs "method"'),
    ('{"method": "eagle"}', "must be one of"),
    ('{"method": "ngram", "lookahead": 2}', "unknown --speculative-config keys"),
    ('{"method": "draft_model"}', '"model"'),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": -1}', "positive"),
    ('{"method": "ngram", "num_speculative_tokens": "3"}', "--speculative-config"),
])
def test_a_bad_config_names_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(text)
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", speculative_config=text)


def test_the_flag_refuses_a_bad_config_at_the_command_line(capsys):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram"}'])
    assert args.speculative_config == '{"method": "ngram"}'
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "magic"}'])
    assert "must be one of" in capsys.readouterr().err


# --- draft sources -----------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(2, 4)
    # "5 6 7" occurred twice: its latest occurrence was followed by 9 10.
    tokens = [1, 5, 6, 7, 8, 2, 5, 6, 7, 9, 10, 3, 4, 5, 6, 7]
    request = decoding("r", tokens, 4)
    assert proposer.propose(request, 2) == [9, 10]
    assert proposer.propose(request, 9) == [9, 10, 3, 4, 5, 6, 7]  # up to the end
    request.append_token(9)  # "6 7 9" is longer than any 2-gram match: it wins
    assert proposer.propose(request, 3) == [10, 3, 4]
    request.append_token(42)  # "9 42" never occurred, nor "42" (below the minimum of 2)
    assert proposer.propose(request, 3) == []
    proposer.finished(request)
    assert proposer.indexes == {}


def test_prompt_lookup_min_from_the_config_reaches_the_ngram_source():
    """Of the tail, only "5 6" (two tokens) occurred before: a minimum of 3 drafts nothing."""
    tokens = [1, 5, 6, 3, 2, 4, 5, 6]
    for lookup_min, drafts in ((3, []), (2, [3, 2, 4])):
        config = SpeculativeConfig.parse(
            '{"method": "ngram", "num_speculative_tokens": 3, '
            f'"prompt_lookup_min": {lookup_min}, "prompt_lookup_max": 4}}')
        speculator = Speculator(config, max_model_len=1000)
        speculator.acceptance["r"] = Acceptance(accepted=9.0, decided=10.0)  # drafts pay
        request = decoding("r", tokens, 4)
        speculator.propose([request], step=1)
        assert request.draft_token_ids == drafts, lookup_min


def test_suffix_drafts_follow_frequent_continuations_and_learn_from_finished_requests():
    proposer = SuffixProposer(max_depth=8, max_spec_factor=4.0, min_token_prob=0.3,
                              max_cached_requests=1)
    first = decoding("a", [1, 2, 3, 4, 5, 6, 7, 8, 20, 21], 8)
    assert proposer.propose(first, 4) == []  # "21" never occurred before
    first.finish("stop")
    proposer.finished(first)
    second = decoding("b", [9, 9, 20], 3)  # "20" was followed by 21 in a's output
    assert proposer.propose(second, 4) == [21]
    # Its own repeats: "3 4" is followed by 5 twice and by 6 once: 5 is drafted, then the
    # walk goes on from "4 5" while the running product of frequencies stays >= 0.3.
    third = decoding("c", [3, 4, 5, 7, 3, 4, 5, 7, 3, 4, 6, 8, 3, 4], 14)
    assert proposer.propose(third, 4) == [5, 7, 3, 4]
    # A second finished request pushes the first's output out (one is kept).
    second.append_token(30)
    second.append_token(31)
    second.finish("stop")
    proposer.finished(second)
    assert proposer.propose(decoding("d", [20], 1), 4) == []
    assert proposer.propose(decoding("e", [30], 1), 4) == [31]


def test_a_sources_sure_draft_needs_a_long_match():
    ngram = NgramProposer(2, 4)
    echoed = decoding("r", [1, 5, 6, 7, 8, 9, 2, 5, 6, 7, 8], 4)  # "5 6 7 8" occurred: 9
    assert ngram.sure_draft(echoed) == [9]
    short = decoding("s", [1, 5, 6, 3, 2, 4, 5, 6], 4)  # only "5 6", two tokens long
    assert ngram.propose(short, 1) == [3] and ngram.sure_draft(short) == []
    suffix = SuffixProposer(max_depth=24, max_spec_factor=4.0, min_token_prob=0.1,
                            max_cached_requests=0)
    phrase = [11, 12, 13, 14, 15, 16]
    long_context = decoding("a", [*phrase, 40, 1, *phrase, 40, 2, *phrase], 8)
    assert suffix.sure_draft(long_context) == [40]  # a 6-token context, always then 40
    split = decoding("b", [*phrase, 40, 1, *phrase, 41, 2, *phrase], 8)
    assert suffix.sure_draft(split) == [40]  # half the time: still sure enough
    three = decoding("c", [*phrase, 40, 1, *phrase, 41, 2, *phrase, 42, 3, *phrase], 8)
    assert suffix.sure_draft(three) == []  # a third each
    brief = decoding("d", [7, 8, 9, 1, 2, 7, 8, 9], 4)  # three tokens of context
    assert suffix.propose(brief, 1) == [1] and suffix.sure_draft(brief) == []


def whole_counts(proposer: SuffixProposer, request: Request) -> FollowCounts:
    """The request's tokens counted whole, as FollowCounts counts finished outputs."""
    counts = FollowCounts(proposer.max_depth)
    counts.add(request.token_ids, 0, request.num_tokens)
    return counts


def finish_output(proposer: SuffixProposer, request_id: str, tokens: list[int],
                  num_prompt: int) -> None:
    """A request that drafted once and finished: its output joins the shared counts."""
    done = decoding(request_id, tokens, num_prompt)
    proposer.propose(done, 1)
    done.finish("stop")
    proposer.finished(done)


def counted_sure_draft(proposer: SuffixProposer, request: Request) -> list[int]:
    return proposer.sure_from(whole_counts(proposer, request), request.token_ids)


def counted_drafts(proposer: SuffixProposer, request: Request, max_drafts: int) -> list[int]:
    return proposer.drafts_from(whole_counts(proposer, request), request.token_ids, max_drafts)


def test_a_suffix_probe_searched_for_equals_one_from_the_whole_counts():
    rng = random.Random(5)
    sure = 0
    for trial in range(400):
        proposer = SuffixProposer(max_depth=24, max_spec_factor=1.0, min_token_prob=0.1,
                                  max_cached_requests=4)
        vocab = rng.choice([3, 5, 20])
        phrase = [rng.randrange(vocab) for _ in range(rng.randrange(5, 30))]
        tokens = (phrase * 5)[:rng.randrange(2, 120)] + [rng.randrange(vocab)
                                                         for _ in range(rng.randrange(3))]
        if trial % 2:  # a finished request's output to draft from too
            output = [rng.randrange(vocab) for _ in range(30)]
            finish_output(proposer, f"f{trial}", [*phrase[:3], *output], 3)
        request = decoding(f"r{trial}", tokens, 1)
        want = counted_sure_draft(proposer, request)
        assert proposer.sure_draft(request) == want
        sure += bool(want)
    assert 40 < sure < 360  # both outcomes were met


def test_drafts_from_a_searched_history_grown_step_by_step_equal_those_from_whole_counts():
    """A request's own windows are indexed as its tokens arrive, a few a step (drafting some
    steps, not others): its drafts equal the walk over its tokens counted whole."""
    rng = random.Random(9)
    drafted = 0
    for trial in range(60):
        proposer = SuffixProposer(max_depth=24, max_spec_factor=2.0, min_token_prob=0.1,
                                  max_cached_requests=2)
        vocab = rng.choice([4, 12, 50])
        phrase = [rng.randrange(vocab) for _ in range(rng.randrange(4, 40))]
        if trial % 3 == 0:  # a finished output to draft from as well
            finish_output(proposer, f"f{trial}", [*phrase, *phrase[:10]], len(phrase))
        stream = phrase * 6 + [rng.randrange(vocab) for _ in range(20)]
        request = decoding(f"r{trial}", stream[:rng.randrange(1, 30)], 1)
        while request.num_tokens < len(stream):
            if rng.random() < 0.5:
                max_drafts = rng.choice([1, 3, 8])
                got = proposer.propose(request, max_drafts)
                assert got == counted_drafts(proposer, request, max_drafts), trial
                drafted += bool(got)
            for token in stream[request.num_tokens:request.num_tokens + rng.choice([1, 2, 5, 9])]:
                request.append_token(token)
    assert drafted > 100


def test_beside_others_a_probe_verifies_only_a_draft_its_source_is_sure_of():
    """A request whose drafts do not pay is probed with one draft now and then: alone, any
    draft its source has; beside other decoding requests (whose steps its row slows too),
    only one its source is sure of."""
    for tokens, beside_others, alone in (([1, 5, 6, 7, 8, 9, 2, 5, 6, 7, 8], [9], [9]),
                                         ([1, 5, 6, 3, 2, 4, 5, 6], [], [3])):
        for others, probed in ((1, beside_others), (0, alone)):
            config = SpeculativeConfig("ngram", prompt_lookup_min=2, prompt_lookup_max=4)
            speculator = Speculator(config, max_model_len=1000)
            for rows in range(1, 12):
                speculator.observe_step(rows, 0.02 * (1 + 0.03 * rows))  # no draft pays
            request = decoding("r", tokens, 4)
            speculator.acceptance["r"] = Acceptance(accepted=0.0, decided=5.0)
            running = [request, *(decoding(f"o{i}", [90, 91], 1) for i in range(others))]
            speculator.propose(running, step=1)
            assert request.draft_token_ids == probed, (tokens, others)


def test_no_probe_where_a_row_costs_the_batch_more_than_a_sure_draft_yields():
    """A probe's row, even accepted, yields its request one token (log 2 in log speed). A
    step costs 5 + rows units: beside 31 others, one more row slows all 32 requests by 1/37
    (32 x log(38/37) = 0.85 > log 2), so no draft could pay and none is probed; the probes
    are still due when the batch shrinks to 8 (8 x log(14/13) = 0.59)."""
    speculator = speculator_with([5] * 4)
    for _ in range(8):
        for rows in range(1, 50):
            speculator.observe_step(rows, 0.001 * (5 + rows))
    batch = [decoding(f"r{i}", [1, 2, 3, 4], 3) for i in range(32)]
    for request in batch:
        speculator.acceptance[request.request_id] = Acceptance(accepted=0.0, decided=5.0)
    for step in range(1, 40):
        speculator.propose(batch, step)
        assert all(r.draft_token_ids == [] for r in batch), step
    speculator.propose(batch[:8], step=40)
    assert [r.draft_token_ids for r in batch[:8]] == [[5]] * 8


def test_every_positions_context_hashes_at_once_equal_the_lookups_one_by_one():
    """The counts (numpy, all positions) and the lookups (one context) key alike; long
    sequences wrap the sums modulo 2^64 many times over."""
    rng = random.Random(5)
    tokens = [rng.randrange(200_000) for _ in range(700)]
    lengths = counted_lengths(24)
    for length in lengths:
        at_once = window_hashes(tokens, 300 - length, 650, length).tolist()
        one_by_one = [dict(context_hashes(tokens, end, 24, lengths))[length]
                      for end in range(300, 651)]
        assert at_once == one_by_one


def test_counting_a_step_at_a_time_equals_counting_a_sequence_at_once():
    """A running request's few new tokens a step (counted one by one) and a finished output
    (counted a context length at a time) leave the same counts; taking one back removes it."""
    rng = random.Random(6)
    tokens = [rng.randrange(40) for _ in range(300)]
    at_once, by_steps = FollowCounts(24), FollowCounts(24)
    at_once.add(tokens, 0, len(tokens))
    start = 0
    while start < len(tokens):
        step = rng.choice([1, 2, 3, 5, 9])
        by_steps.add(tokens, start, min(start + step, len(tokens)))
        start += step
    assert by_steps.counts == at_once.counts and len(at_once.counts) > 1000
    by_steps.add(tokens, 150, 152, sign=-1)
    at_once.add(tokens[:152], 150, 152, sign=-1)
    assert by_steps.counts == at_once.counts


def test_suffix_drafts_stop_where_the_context_is_too_uncertain():
    proposer = SuffixProposer(max_depth=4, max_spec_factor=8.0, min_token_prob=0.5,
                              max_cached_requests=0)
    # After 1: 2, 3 and 4 once each: no token reaches half of the continuations.
    request = decoding("r", [1, 2, 1, 3, 1, 4, 1], 7)
    assert proposer.propose(request, 4) == []


# --- verification ------------------------------------------------------------------------
def test_accepted_tokens_are_the_matching_drafts_then_the_rows_own_sample():
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accepted_tokens([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert accepted_tokens([], [3]) == [3]
    tokens, logprobs = split_samples([5, 9, 7, 8, 3], [None] * 5, [[5, 6, 7], []])
    assert tokens == [[5, 9], [3]] and logprobs == [None, None]


def test_each_drafted_row_sees_the_drafts_before_it_as_output():
    request = decoding("r", [1, 2, 3, 4], 3, frequency_penalty=0.5, min_tokens=3)
    rows = drafted_rows([request, decoding("s", [7, 8], 1)], [[5, 5], []])
    assert [type(row).__name__ for row in rows] == ["DraftedRow"] * 3 + ["Request"]
    assert [row.num_output_tokens for row in rows[:3]] == [1, 2, 3]
    assert [row.output_token_counts for row in rows[:3]] == [{4: 1}, {4: 1, 5: 1},
                                                              {4: 1, 5: 2}]
    assert request.output_token_counts == {4: 1}  # the request itself is untouched
    assert isinstance(rows[0], DraftedRow) and rows[0].request_id == "r"


# --- how many drafts pay -----------------------------------------------------------------
def test_acceptance_falls_with_rejections_and_rises_with_acceptances():
    acceptance = Acceptance()
    start = acceptance.rate
    for _ in range(5):
        acceptance.record(num_drafts=4, num_accepted=0)
    assert acceptance.rate < 0.1 < start
    for _ in range(10):
        acceptance.record(num_drafts=4, num_accepted=4)
    assert acceptance.rate > 0.9
    cautious = acceptance.cautious_rate  # less one standard error of ~5 verifications' worth
    assert acceptance.rate - 0.2 < cautious < acceptance.rate
    assert acceptance.yields(3) == pytest.approx([cautious ** j for j in (1, 2, 3)])
    fresh = Acceptance()  # the prior alone: 0.6 on 2 verifications' worth
    assert fresh.cautious_rate == pytest.approx(0.6 - (0.6 * 0.4 / 2) ** 0.5)


def test_the_cost_table_uses_what_it_saw_often_and_leans_on_its_line_elsewhere():
    cost = StepCost()
    for _ in range(40):
        for rows, seconds in [(1, 0.020), (2, 0.022), (4, 0.025), (5, 0.041)]:
            cost.observe(rows, seconds)
    assert cost.seconds(5) == pytest.approx(0.041, rel=0.1)  # the jump at five rows stands
    assert cost.seconds(1) == pytest.approx(0.020, rel=0.1)
    assert cost.seconds(3) == pytest.approx(0.024, rel=0.3)  # from the fitted line
    assert cost.seconds(6) >= cost.seconds(5)  # never below a smaller count's time
    cost.observe(7, 0.005)  # one noisy step far below every other: the line outweighs it
    assert cost.seconds(7) > 0.03


def test_a_slow_step_moves_the_cost_table_little_and_a_lasting_change_moves_it():
    cost = StepCost()
    for _ in range(20):
        for rows, seconds in [(1, 0.020), (5, 0.041)]:
            cost.observe(rows, seconds)
    for rows in (1, 5):  # a hiccup at each count (the machine paused the process)
        cost.observe(rows, 0.200)
    assert cost.seconds(1) == pytest.approx(0.020, rel=0.05)
    assert cost.seconds(5) == pytest.approx(0.041, rel=0.05)
    for _ in range(12):  # five rows got cheaper for good (say, a kernel that serves them)
        cost.observe(1, 0.020)
        cost.observe(5, 0.031)
    assert cost.seconds(5) == pytest.approx(0.031, rel=0.05)


def test_a_count_seen_long_ago_keeps_its_cost_relative_to_the_plain_step():
    """A busy server: 32 decoding rows, one draft row now and then. Early, 33 rows took 3%
    more than 32; since then contexts grew and every step takes a third more: 33 rows still
    cost 3% more than 32, not less (their absolute times went stale)."""
    cost = StepCost()
    for step in range(400):
        plain = 0.030 * (1 + step / 1200)
        cost.observe(32, plain)
        if step < 40 and step % 4 == 0:
            cost.observe(33, plain * 1.03)
    assert cost.seconds(32) == pytest.approx(0.040, rel=0.02)
    assert cost.seconds(33) / cost.seconds(32) == pytest.approx(1.03, abs=0.01)


def test_when_the_batch_shrinks_for_good_the_costs_keep_their_ratios():
    cost = StepCost()
    for _ in range(30):
        for rows, seconds in [(32, 0.040), (33, 0.042), (28, 0.036)]:
            cost.observe(rows, seconds)
    for _ in range(100):  # 32 and 33 rows are not run again
        cost.observe(28, 0.036)
    assert cost.anchor == 28
    assert cost.seconds(33) / cost.seconds(32) == pytest.approx(0.042 / 0.040, rel=0.01)
    assert cost.seconds(28) == pytest.approx(0.036, rel=0.02)


class FixedDrafts:
    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        return self.drafts[:max_drafts]

    def finished(self, request: Request) -> None:
        pass


def speculator_with(drafts: list[int], max_drafts: int = 6) -> Speculator:
    config = SpeculativeConfig("ngram", num_speculative_tokens=max_drafts)
    return Speculator(config, max_model_len=1000, source=FixedDrafts(drafts))


def test_drafts_stop_at_the_jump_in_step_time():
    """Four rows cost little more than one, a fifth doubles the step: three drafts pay."""
    speculator = speculator_with([5] * 6)
    for rows, seconds in [(1, 0.020), (2, 0.021), (3, 0.022), (4, 0.023), (5, 0.045),
                          (6, 0.046), (7, 0.047)]:
        speculator.observe_step(rows, seconds)
    request = decoding("r", [1, 2, 3, 4], 3)
    speculator.acceptance["r"] = Acceptance(accepted=9.0, decided=10.0)  # q = 0.9
    speculator.propose([request], step=1)
    assert request.draft_token_ids == [5, 5, 5]


def observe_a_mildly_rising_step_cost(speculator: Speculator) -> None:
    for _ in range(20):
        for rows in range(1, 40):
            speculator.observe_step(rows, 0.020 * (1 + 0.03 * rows))  # 3% a row


@pytest.mark.parametrize("num_others", [0, 3])
def test_a_request_takes_fewer_drafts_as_its_drafts_are_rejected(num_others):
    """Alone or beside other decoding requests: many drafts at q = 0.9, fewer at 0.5, none
    (beyond a probe) once q is a few percent."""
    speculator = speculator_with([5] * 6)
    observe_a_mildly_rising_step_cost(speculator)
    request = decoding("r", [1, 2, 3, 4], 3)
    running = [request, *(decoding(f"o{i}", [1, 2, 3, 4], 3) for i in range(num_others))]
    acceptance = speculator.acceptance["r"] = Acceptance(accepted=9.0, decided=10.0)
    rates, counts = [], []
    for step in range(1, 20):
        rooms = {r.request_id: (r, 6) for r in running}
        taken, _ = speculator._worth_taking(len(running), rooms, step)
        rates.append(acceptance.rate)
        counts.append(taken["r"])
        speculator.record(request, [5] * 6, [6])  # the first draft rejected
    assert counts == sorted(counts, reverse=True)
    at_half = counts[next(i for i, rate in enumerate(rates) if rate <= 0.55)]
    assert counts[0] >= 4 and counts[0] > at_half > 0 and counts[-1] == 0
    assert rates[-1] < 0.05


def test_beside_a_request_whose_drafts_are_accepted_only_the_rejected_one_stops_drafting():
    speculator = speculator_with([5] * 6)
    observe_a_mildly_rising_step_cost(speculator)
    accepted = decoding("a", [1, 2, 3, 4], 3)
    rejected = decoding("b", [1, 2, 3, 4], 3)
    accepted_counts, rejected_counts = [], []
    for step in range(1, 41):
        speculator.propose([accepted, rejected], step)
        accepted_counts.append(len(accepted.draft_token_ids))
        rejected_counts.append(len(rejected.draft_token_ids))
        speculator.record(accepted, accepted.draft_token_ids, [*accepted.draft_token_ids, 7])
        speculator.record(rejected, rejected.draft_token_ids, [7])
    assert accepted_counts[10:] == [6] * 30
    # After ten rounds, the rejected one verifies only a probe's single draft now and then.
    assert max(rejected_counts[10:]) == 1 and sum(rejected_counts[10:]) <= 2


def test_drafts_that_rarely_pay_stop_and_are_tried_again_after_a_growing_pause():
    speculator = speculator_with([5] * 4)
    for rows in range(1, 12):
        speculator.observe_step(rows, 0.02 * rows)  # each row costs a whole step
    request = decoding("r", [1, 2, 3, 4], 3)
    drafted_at = []
    for step in range(1, 60):
        speculator.propose([request], step)
        if request.draft_token_ids:
            drafted_at.append(step)
            assert request.draft_token_ids == [5]  # a probe: one draft
            speculator.record(request, request.draft_token_ids, [6])  # rejected
    gaps = [b - a for a, b in itertools.pairwise(drafted_at)]
    assert len(drafted_at) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0]


def test_no_drafts_past_max_tokens_the_model_length_or_the_batch_size_limit():
    speculator = speculator_with([5] * 6)
    near_the_end = decoding("r", [1, 2, 3, 4, 4], 3, max_tokens=4)  # 2 of 4 out: room for 1
    prefilling = make_request("p", prompt_len=8)
    speculator.propose([near_the_end, prefilling], step=1)
    assert near_the_end.draft_token_ids == [5] and prefilling.draft_token_ids == []
    limited = Speculator(SpeculativeConfig("ngram", disable_by_batch_size=1), 1000,
                         FixedDrafts([5]))
    others = decoding("s", [1, 2, 3, 4], 3)
    limited.propose([others, decoding("t", [1, 2, 3, 4], 3)], step=1)
    assert others.draft_token_ids == []


def test_the_counters_count_drafts_accepted_tokens_and_positions():
    speculator = speculator_with([5, 6, 7])
    request = decoding("r", [1, 2, 3, 4], 3)
    speculator.record(request, [5, 6, 7], [5, 6, 9])
    speculator.record(request, [5, 6], [1])
    speculator.record(request, [], [1])  # no drafts: not a verification
    totals = speculator.totals
    assert (totals.num_drafts, totals.num_draft_tokens, totals.num_accepted_tokens) == (2, 5, 2)
    assert totals.accepted_by_position[:3] == [1, 1, 0]


# --- the scheduler's draft slots ---------------------------------------------------------
def test_drafts_take_budget_and_blocks_but_leave_a_token_for_every_later_request():
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    requests = [make_request(f"r{i}", prompt_len=3, max_tokens=20) for i in range(3)]
    for request in requests:
        scheduler.add(request)
    output = scheduler.schedule()
    scheduler.update(output, {c.request.request_id: [9] for c in output.chunks})
    for request in requests:
        request.draft_token_ids = [1, 2, 3, 4, 5, 6]
    output = scheduler.schedule()
    # 8 tokens: r0 takes its decode and 5 drafts, r1 and r2 a decode each.
    assert [c.num_tokens for c in output.chunks] == [6, 1, 1]
    assert output.chunks[0].draft_token_ids == [1, 2, 3, 4, 5]
    assert len(requests[0].block_tables[0]) == 3  # 4 tokens + 5 drafts: 9 slots
    # Two drafts accepted, then the row's own token: the slots past them go back.
    scheduler.update(output, {"r0": [1, 2, 7], "r1": [9], "r2": [9]})
    assert requests[0].output_token_ids == [9, 1, 2, 7]
    assert requests[0].num_computed_tokens == 6 and len(requests[0].block_tables[0]) == 2
    assert scheduler.block_manager.check_integrity(scheduler.live_requests) == []


def test_drafts_never_preempt_and_a_stop_among_them_ends_the_request_there():
    scheduler = make_scheduler(num_blocks=2, block_size=4)
    request = make_request("r", prompt_len=3, max_tokens=5)
    scheduler.add(request)
    output = scheduler.schedule()
    scheduler.update(output, {"r": [9]})
    request.draft_token_ids = [1] * 6  # 4 + 6 slots need 3 blocks of the 2 there are
    output = scheduler.schedule()
    assert output.chunks[0].draft_token_ids == [] and not output.trace.preempted
    scheduler.update(output, {"r": [9]})
    request.draft_token_ids = [1, 0, 5]  # 0 is the EOS
    output = scheduler.schedule()
    sampled = {"r": [1, 0, 5, 6]}
    finished = scheduler.update(output, sampled)
    assert finished == [request] and request.finish_reason == "stop"
    assert sampled["r"] == [1, 0] and request.output_token_ids == [9, 9, 1, 0]
    assert scheduler.block_manager.num_free_blocks == 2


def test_a_step_with_nobody_decoding_drafts_nothing_whatever_the_cost_table():
    """A fitted line that reaches zero at zero rows must not divide anything by it."""
    speculator = speculator_with([5])
    speculator.observe_step(4, 0.094)
    speculator.observe_step(3, 0.056)
    fresh = make_request("fresh", prompt_len=8)
    speculator.propose([], step=1)
    speculator.propose([fresh], step=2)
    assert fresh.draft_token_ids == []
    assert all(speculator.cost.seconds(rows) > 0 for rows in range(0, 9))


def test_the_cost_of_a_range_of_row_counts_is_each_counts_cost():
    cost = StepCost()
    for rows, seconds in [(1, 0.020), (3, 0.018), (4, 0.025), (9, 0.060)]:
        cost.observe(rows, seconds)
    assert cost.seconds_from(0, 12) == [cost.seconds(rows) for rows in range(0, 13)]


def test_alone_a_request_drafts_at_its_rate_beside_others_one_standard_error_low():
    """Rate 0.8 seen over two verifications (less one standard error: 0.52). One more row
    costs a lone stream 60% (a draft pays above q = 0.62) and each of two streams 30% (twice
    that in log speed: above q = 0.7): alone, the rate as it stands pays for a draft; beside
    another request, whose step it slows too, the cautious one does not."""
    alone = speculator_with([5] * 6, max_drafts=1)
    alone.observe_step(1, 0.010)
    alone.observe_step(2, 0.016)
    alone.acceptance["r"] = Acceptance(accepted=1.6, decided=2.0, paused_until=10)
    request = decoding("r", [1, 2, 3, 4], 3)
    alone.propose([request], step=1)
    assert request.draft_token_ids == [5]

    beside = speculator_with([5] * 6, max_drafts=1)
    beside.observe_step(2, 0.010)
    beside.observe_step(3, 0.013)
    pair = [decoding("r", [1, 2, 3, 4], 3), decoding("s", [1, 2, 3, 4], 3)]
    for other in pair:
        beside.acceptance[other.request_id] = Acceptance(accepted=1.6, decided=2.0,
                                                         paused_until=10)
    beside.propose(pair, step=1)
    assert [r.draft_token_ids for r in pair] == [[], []]
