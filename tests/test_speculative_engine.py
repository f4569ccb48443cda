"""Speculative decoding on a tiny random-weight Llama (fp32), in-process: greedy output equals
the engine without drafts and transformers, whatever the batch does; sampled output keeps
the model's distribution; seeds, stops, logprobs, penalties and grammars behave as without
drafts; rejected drafts leave no KV behind.

Most tests draft from an oracle: the output the engine gives without drafts, spoiled at
known places, so that drafts are accepted and rejected at every position. A random-weight
model repeats itself too little for the n-gram and suffix sources to be exercised so."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.protocol import AddRequest
from common.sampling import SamplingParams
from engine.block_manager import ROOT_HASH, hash_block
from engine.request import Request
from engine.speculative import verify
from engine.speculative.speculator import Acceptance
from frontend.choices import choice_requests
from tests.engine_helpers import (
    assert_equals_transformers_generate,
    assert_greedy_equal_or_near_tie,
    assert_no_leaks,
    greedy_request,
    make_core,
    run_to_completion,
)
from tests.model_fixtures import build_tiny_llama_dir
from tests.test_structured_engine import GRAMMARS, assert_conforms
from tests.tiny_server import build_tiny_served_model

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4})


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    return build_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(7 * i + 13 * salt) % 200 + 3 for i in range(length)]


class OracleDrafts:
    """Drafts the request's known continuation, with every `spoil_every`-th draft call's
    second token (its only one, if one) replaced: accepted runs, rejections at every
    position, and tail drafts."""

    def __init__(self, continuations: dict[str, list[int]], spoil_every: int = 3,
                 spoil_with: int | None = None) -> None:
        self.continuations = continuations
        self.spoil_every = spoil_every
        self.spoil_with = spoil_with
        self.calls = itertools.count()

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        known = self.continuations.get(request.request_id, [])
        drafts = list(known[request.num_output_tokens:request.num_output_tokens + max_drafts])
        spoiled = min(1, len(drafts) - 1)
        if drafts and next(self.calls) % self.spoil_every == 0:
            drafts[spoiled] = self.spoil_with if self.spoil_with is not None \
                else (drafts[spoiled] + 1) % 256
        return drafts

    def finished(self, request: Request) -> None:
        pass


class FixedCost:
    """Step time as a function of rows alone (the measured one varies run to run): every
    offered draft pays, so which drafts are verified is the same on every run."""

    def observe(self, num_rows: int, seconds: float) -> None:
        pass

    def seconds(self, num_rows: int) -> float:
        return 1.0 + 0.01 * num_rows

    def seconds_from(self, first_rows: int, count: int) -> list[float]:
        return [self.seconds(rows) for rows in range(first_rows, first_rows + count + 1)]


class PointMassDrafts(OracleDrafts):
    """At the second output token, the likeliest one after the sampled first under the
    model's top 3 (an n-gram draft is such a point mass); nothing elsewhere."""

    def __init__(self, reference_model, prompt: list[int]) -> None:
        super().__init__({})
        self.likeliest_after = {}
        for first in {pair[0] for pair in joint_distribution(reference_model, prompt, top_k=3)}:
            pairs = joint_distribution(reference_model, [*prompt, first], top_k=3)
            self.likeliest_after[first] = max(pairs, key=pairs.get)[0]

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        if request.num_output_tokens != 1:
            return []
        return [self.likeliest_after[request.output_token_ids[0]]][:max_drafts]


def after_each_call(target: object, name: str, hook: Callable[..., None]) -> None:
    """Wraps `target.name`: after each call, `hook(result, *args)` sees what it returned and
    was given."""
    original = getattr(target, name)

    def wrapped(*args):
        result = original(*args)
        hook(result, *args)
        return result
    setattr(target, name, wrapped)


def spec_core(model_dir: str, continuations: dict[str, list[int]], **overrides):
    core = make_core(model_dir, speculative_config=NGRAM, **overrides)
    core.speculator.source = OracleDrafts(continuations)
    core.speculator.cost = FixedCost()
    return core


def accepted_positions(core) -> list[int]:
    return core.speculator.totals.accepted_by_position


def test_greedy_drafts_equal_the_engine_without_them_in_a_preempting_chunked_batch(
        tiny_model_dir, reference_model):
    lengths = [3, 17, 40, 9, 64, 1, 25, 33]
    shared = prompt_of(32, 99)  # two requests share a 2-block prefix: a prefix-cache hit
    prompts = [prompt_of(n, i) for i, n in enumerate(lengths)] + [[*shared, 5], [*shared, 6]]
    batch = [greedy_request(p, max_tokens=24, request_id=f"r{i}") for i, p in enumerate(prompts)]
    plain = run_to_completion(make_core(tiny_model_dir, num_kv_blocks=16,
                                        max_num_batched_tokens=48), batch)
    # 16 blocks of 16 tokens for 10 requests of up to 64 + 24 tokens: preemption is certain;
    # a 48-token budget chunks the long prompts beside the drafted decodes.
    core = spec_core(tiny_model_dir, plain, num_kv_blocks=16, max_num_batched_tokens=48)
    drafted = run_to_completion(core, batch)
    assert core.scheduler.num_preemptions >= 1
    assert core.block_manager.stats.hits > 0
    assert any(n > 1 for trace in core.traces for n in trace.scheduled.values()
               if len(trace.scheduled) > 1)
    by_position = accepted_positions(core)
    assert all(count > 0 for count in by_position), by_position
    assert core.speculator.totals.num_accepted_tokens < core.speculator.totals.num_draft_tokens
    assert core.totals.num_steps < make_steps(plain)  # drafts saved steps
    assert drafted == plain
    assert_equals_transformers_generate(drafted, batch, reference_model)


def make_steps(outputs: dict[str, list[int]]) -> int:
    return max(map(len, outputs.values()))


def test_the_ngram_and_suffix_sources_keep_greedy_output(tiny_model_dir, reference_model):
    # A prompt that repeats itself: its own n-grams draft the repeats.
    prompts = [prompt_of(12, 1) * 4, prompt_of(30, 2), prompt_of(9, 3) * 5]
    batch = [greedy_request(p, max_tokens=40) for p in prompts]
    plain = run_to_completion(make_core(tiny_model_dir), batch)
    for method in ("ngram", "suffix"):
        core = make_core(tiny_model_dir, speculative_config=json.dumps(
            {"method": method, "num_speculative_tokens": 5}))
        outputs = run_to_completion(core, batch)
        assert core.speculator.totals.num_draft_tokens > 0, method
        for request in batch:
            assert_greedy_equal_or_near_tie(
                outputs[request.request_id], plain[request.request_id],
                request.prompt_token_ids, lambda ids: reference_model(
                    torch.tensor([ids])).logits[0, -1].detach())


def joint_distribution(reference, prompt: list[int], top_k: int) -> dict[tuple[int, int], float]:
    """p(x1, x2) of top-k sampling at temperature 1, from transformers' logits."""

    def top_k_probs(token_ids: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = reference(torch.tensor([token_ids])).logits[0, -1]
        values, ids = logits.topk(top_k)
        return dict(zip(ids.tolist(), values.softmax(-1).tolist(), strict=True))

    return {(x1, x2): p1 * p2 for x1, p1 in top_k_probs(prompt).items()
            for x2, p2 in top_k_probs([*prompt, x1]).items()}


def test_sampled_output_keeps_the_models_distribution(tiny_model_dir, reference_model):
    """2,000 seeded three-token samples (top-k 3, temperature 1), the 2nd token drafted as a
    point mass (its likeliest value): accepted, the 3rd comes from the draft's own row in
    the same step; rejected, the 2nd is the residual's sample. The (2nd, 3rd) pairs given
    the 1st pass a chi-square test against the exact distribution, and so does
    the engine without drafts (the test can tell). Seeds fix every draw: the statistic is
    the same on every run."""
    prompt = prompt_of(10, 7)
    requests = [AddRequest(f"s{seed}", prompt, SamplingParams(
        max_tokens=3, temperature=1.0, top_k=3, seed=seed, ignore_eos=True), 0.0)
        for seed in range(2000)]

    for drafting in (True, False):
        core = make_core(tiny_model_dir, max_num_seqs=256, max_num_batched_tokens=2048,
                         speculative_config=NGRAM if drafting else None)
        if drafting:
            core.speculator.source = PointMassDrafts(reference_model, prompt)
            core.speculator.cost = FixedCost()
        outputs = run_to_completion(core, list(requests))
        if drafting:
            totals = core.speculator.totals
            assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens == 2000
        statistic, degrees = chi_square_of_pairs(outputs, reference_model, prompt)
        assert statistic < chi_square_bound(degrees), (drafting, statistic, degrees)


def test_unseeded_sampled_output_keeps_the_models_distribution_and_a_wrong_rule_would_not(
        tiny_model_dir, reference_model, monkeypatch):
    """As above, with unseeded requests: every row's noise comes from the engine's one shared
    generator. Then, on the same engine, a broken acceptance rule (every fourth rejected
    draft accepted anyway, so the likeliest 2nd token is drawn about (1 - p) / 4 too often)
    fails the same test: the statistic can tell a wrong rule at this sample size."""
    prompt = prompt_of(10, 7)

    def unseeded(name: str) -> list[AddRequest]:
        return [AddRequest(f"{name}{index}", prompt, SamplingParams(
            max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True), 0.0)
            for index in range(2000)]

    core = make_core(tiny_model_dir, max_num_seqs=256, max_num_batched_tokens=2048,
                     speculative_config=NGRAM)
    core.speculator.source = PointMassDrafts(reference_model, prompt)
    core.speculator.cost = FixedCost()
    outputs = run_to_completion(core, unseeded("u"))
    totals = core.speculator.totals
    assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens == 2000
    statistic, degrees = chi_square_of_pairs(outputs, reference_model, prompt)
    assert statistic < chi_square_bound(degrees), (statistic, degrees)

    right_rule = verify.accepted_tokens
    rejections = itertools.count(1)

    def every_fourth_rejection_accepted(drafts: list[int], samples: list[int]) -> list[int]:
        taken = right_rule(drafts, samples)
        if len(taken) <= len(drafts) and next(rejections) % 4 == 0:
            return [*drafts[:len(taken)], samples[len(taken)]]
        return taken

    monkeypatch.setattr(verify, "accepted_tokens", every_fourth_rejection_accepted)
    accepted_before = totals.num_accepted_tokens
    broken = run_to_completion(core, unseeded("b"))
    assert totals.num_accepted_tokens - accepted_before > accepted_before * 1.1
    statistic, degrees = chi_square_of_pairs(broken, reference_model, prompt)
    assert statistic > chi_square_bound(degrees), (statistic, degrees)


def chi_square_of_pairs(outputs: dict[str, list[int]], reference, prompt: list[int],
                        ) -> tuple[float, int]:
    """Pearson's statistic of the (2nd, 3rd) tokens given the 1st against the exact
    conditional distribution, cells expecting fewer than 5 pooled; summed over 1st tokens,
    with its degrees of freedom."""
    by_first: dict[int, list[tuple[int, int]]] = {}
    for tokens in outputs.values():
        by_first.setdefault(tokens[0], []).append((tokens[1], tokens[2]))
    statistic, degrees = 0.0, 0
    for first, pairs in by_first.items():
        expected = joint_distribution(reference, [*prompt, first], top_k=3)
        assert set(pairs) <= set(expected), "a sample outside the top-3 support"
        cells: list[tuple[float, int]] = []
        pooled_mean, pooled_count = 0.0, 0
        for pair, probability in expected.items():
            count = pairs.count(pair)
            if probability * len(pairs) >= 5:
                cells.append((probability * len(pairs), count))
            else:
                pooled_mean, pooled_count = pooled_mean + probability * len(pairs), \
                    pooled_count + count
        if pooled_mean > 0:
            cells.append((pooled_mean, pooled_count))
        statistic += sum((count - mean) ** 2 / mean for mean, count in cells)
        degrees += len(cells) - 1
    return statistic, max(degrees, 1)


def chi_square_bound(degrees: int) -> float:
    """The 0.999 quantile of chi-square, by the Wilson-Hilferty approximation."""
    z = 3.09
    return degrees * (1 - 2 / (9 * degrees) + z * math.sqrt(2 / (9 * degrees))) ** 3


def test_seeded_samples_repeat_alone_beside_others_and_without_drafts(tiny_model_dir):
    """A seeded position's noise depends on (seed, position) alone, and a drafted row's
    sample is the sample a step without drafts would draw there: the same tokens alone,
    again, beside others, and with no drafts at all."""
    repeating = prompt_of(10, 4) * 3

    def seeded(request_id: str, seed: int) -> AddRequest:
        return AddRequest(request_id, repeating, SamplingParams(
            max_tokens=30, temperature=0.8, seed=seed, ignore_eos=True), 0.0)

    core = make_core(tiny_model_dir, speculative_config=NGRAM)
    core.speculator.cost = FixedCost()  # drafts pay: they are verified on every run
    alone = run_to_completion(core, [seeded("a", 11)])["a"]
    again = run_to_completion(core, [seeded("b", 11)])["b"]
    others = [greedy_request(prompt_of(20 + i, i), max_tokens=25) for i in range(6)]
    beside = run_to_completion(core, [seeded("c", 11), *others])["c"]
    plain = run_to_completion(make_core(tiny_model_dir), [seeded("d", 11)])["d"]
    assert alone == again == beside == plain
    assert core.speculator.totals.num_accepted_tokens > 0


def test_n_seeded_samples_of_one_prompt_with_drafts_equal_them_without(tiny_model_dir):
    """n=3 with a seed, as the frontend fans it out (seeds s, s+1, s+2, one prompt shared in
    the prefix cache): each sample with oracle drafts, accepted in runs, equals the same
    sample without drafts, and the three differ."""
    prompt = prompt_of(40, 12)
    requests = choice_requests("n3", [prompt], [SamplingParams(
        max_tokens=30, temperature=0.9, top_p=0.95, seed=17, ignore_eos=True)], 3, 0.0)
    assert [r.sampling.seed for r in requests] == [17, 18, 19]
    plain = run_to_completion(make_core(tiny_model_dir), requests)
    assert len({tuple(tokens) for tokens in plain.values()}) == 3
    core = spec_core(tiny_model_dir, plain)
    accepted: dict[str, int] = dict.fromkeys(plain, 0)

    def count_accepted(_, request, drafts, tokens):
        accepted[request.request_id] += min(len(tokens) - 1, len(drafts))
    after_each_call(core.speculator, "record", count_accepted)
    assert run_to_completion(core, requests) == plain
    assert all(count >= 5 for count in accepted.values()), accepted
    assert core.speculator.totals.num_accepted_tokens == sum(accepted.values())
    assert core.speculator.totals.num_accepted_tokens < core.speculator.totals.num_draft_tokens
    assert core.block_manager.stats.hits > 0


def test_stops_max_tokens_and_logprobs_behave_as_without_drafts(tiny_model_dir):
    prompts = [prompt_of(12, 1), prompt_of(20, 2)]
    plain = run_to_completion(make_core(tiny_model_dir), [greedy_request(p, 30, f"r{i}")
                                                          for i, p in enumerate(prompts)])
    stop_at = plain["r0"][9]  # a stop token met inside a run of accepted drafts
    first_stop = plain["r0"].index(stop_at)
    requests = [greedy_request(prompts[0], 30, "r0", stop_token_ids=[stop_at], logprobs=3),
                greedy_request(prompts[1], 13, "r1", logprobs=3)]
    drafting = spec_core(tiny_model_dir, plain)
    results = {}
    for name, core in (("plain", make_core(tiny_model_dir)), ("drafts", drafting)):
        reasons: dict[str, str] = {}
        tokens, logprobs = collect_with_logprobs(core, requests, reasons)
        results[name] = logprobs
        assert tokens["r0"] == plain["r0"][:first_stop + 1] and reasons["r0"] == "stop"
        assert tokens["r1"] == plain["r1"][:13] and reasons["r1"] == "length"
        assert [len(logprobs[r]) for r in ("r0", "r1")] == [len(tokens["r0"]), 13]
    assert drafting.speculator.totals.num_accepted_tokens >= 5
    for request_id in ("r0", "r1"):
        for got, want in zip(results["drafts"][request_id], results["plain"][request_id],
                             strict=True):
            assert got[0] == pytest.approx(want[0], abs=1e-4)
            assert [pair[0] for pair in got[1]] == [pair[0] for pair in want[1]]


def collect_with_logprobs(core, requests: list[AddRequest], reasons: dict[str, str],
                          num_cached: dict[str, int] | None = None,
                          ) -> tuple[dict[str, list[int]], dict[str, list]]:
    """Each request's tokens and logprobs (and, in `num_cached`, its prompt tokens found in
    the prefix cache)."""
    for request in requests:
        core.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    logprobs: dict[str, list] = {r.request_id: [] for r in requests}
    cached = {} if num_cached is None else num_cached
    while core.has_work:
        for output in core.step().outputs:
            assert output.request_id not in reasons, "tokens after the finish"
            tokens[output.request_id] += output.new_token_ids
            logprobs[output.request_id] += output.logprobs
            assert len(output.logprobs) == len(output.new_token_ids)
            cached[output.request_id] = output.num_cached_tokens
            if output.finish_reason is not None:
                reasons[output.request_id] = output.finish_reason
    assert_no_leaks(core)
    return tokens, logprobs


def test_penalties_and_min_tokens_see_the_drafts_before_each_row(tiny_model_dir):
    sampling = {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.3}
    prompt = prompt_of(10, 5) * 2
    plain_core = make_core(tiny_model_dir)
    eos = min(plain_core.eos_token_ids)
    batch = [greedy_request(prompt, 30, "pen", **sampling),
             AddRequest("min", prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                      min_tokens=8, logit_bias={eos: 30.0}),
                        0.0)]
    plain = run_to_completion(plain_core, batch)
    assert len(plain["min"]) == 9 and plain["min"][-1] == eos  # EOS from its 9th token on
    continuations = dict(plain)
    continuations["min"] = [eos] * 12  # drafts EOS where min_tokens forbids it
    core = spec_core(tiny_model_dir, continuations)
    assert run_to_completion(core, batch) == plain
    assert core.speculator.totals.num_accepted_tokens > 0


def test_rejected_drafts_leave_no_blocks_behind(tiny_model_dir):
    """Every step: a drafted request holds the blocks of its tokens, not of its drafts."""
    prompt = prompt_of(15, 8)
    plain = run_to_completion(make_core(tiny_model_dir), [greedy_request(prompt, 60, "r")])

    class Wrong(OracleDrafts):
        def propose(self, request: Request, max_drafts: int) -> list[int]:
            right = super().propose(request, max_drafts)
            return [(token + 1) % 256 for token in right]  # all rejected

    core = make_core(tiny_model_dir, speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 20}), block_size=4)
    core.speculator.source = Wrong(plain)
    core.speculator.cost = FixedCost()
    core.speculator.acceptance["r"] = Acceptance(accepted=9.0, decided=10.0)  # q = 0.9
    core.add_request(greedy_request(prompt, 60, "r"))
    tokens: list[int] = []
    while core.has_work:
        tokens += [t for o in core.step().outputs for t in o.new_token_ids]
        for request in core.scheduler.running:
            assert len(request.block_tables[0]) <= -(-request.num_tokens // 4)
        assert_no_leaks(core)
    assert tokens == plain["r"]
    assert core.speculator.totals.num_draft_tokens > 20
    assert core.speculator.totals.num_accepted_tokens == 0


def test_the_prefix_cache_hashes_accepted_tokens_only_and_serves_them_to_a_later_request(
        tiny_model_dir):
    """Blocks of 4 tokens, every other draft call spoiled: rejected drafts land inside
    blocks that later fill and join the prefix cache. The cache then holds exactly the
    chain of the request's accepted tokens' full, computed blocks; and a request quoting
    the first one's prompt and output is served those blocks (generated positions too)
    and continues as an engine that computes them afresh does, logprobs included."""
    block_size = 4
    prompt = prompt_of(12, 11)
    first = greedy_request(prompt, 40, "first")  # its last token ends a block: never run
    uncached = make_core(tiny_model_dir, block_size=block_size, enable_prefix_caching=False)
    plain = run_to_completion(uncached, [first])
    core = spec_core(tiny_model_dir, plain, block_size=block_size)
    core.speculator.source.spoil_every = 2
    rejected_at: list[int] = []  # positions of tokens that replaced a rejected draft

    def note_rejection(_, request, drafts, tokens):
        if drafts and len(tokens) <= len(drafts):
            rejected_at.append(request.num_tokens - 1)
    after_each_call(core.speculator, "record", note_rejection)
    assert run_to_completion(core, [first]) == plain
    accepted = [*prompt, *plain["first"]]
    num_computed_blocks = (len(accepted) - 1) // block_size  # the last token was never run
    rejected_in_cached_blocks = {p % block_size for p in rejected_at
                                 if p < num_computed_blocks * block_size}
    assert rejected_in_cached_blocks == set(range(block_size)), rejected_at

    chain, parent = [], ROOT_HASH
    for index in range(num_computed_blocks):
        parent = hash_block(parent, tuple(accepted[index * block_size:(index + 1) * block_size]))
        chain.append(parent)
    manager = core.block_manager
    assert set(manager.cached[0]) == set(chain)
    for index, block_hash in enumerate(chain):
        block = manager.blocks[manager.cached[0][block_hash]]
        assert block.token_ids == tuple(accepted[index * block_size:(index + 1) * block_size])

    quoting = AddRequest("second", accepted, SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2), 0.0)
    fresh_cached: dict[str, int] = {}
    fresh, fresh_logprobs = collect_with_logprobs(uncached, [quoting], {}, fresh_cached)
    assert fresh_cached["second"] == 0
    core.speculator.source.continuations["second"] = fresh["second"]
    hit_cached: dict[str, int] = {}
    accepted_before = core.speculator.totals.num_accepted_tokens
    hit, hit_logprobs = collect_with_logprobs(core, [quoting], {}, hit_cached)
    assert hit_cached["second"] == num_computed_blocks * block_size > len(prompt)
    assert core.speculator.totals.num_accepted_tokens > accepted_before
    assert hit == fresh
    for got, want in zip(hit_logprobs["second"], fresh_logprobs["second"], strict=True):
        assert got[0] == pytest.approx(want[0], abs=1e-4)
        assert [pair[0] for pair in got[1]] == [pair[0] for pair in want[1]]
        assert [pair[1] for pair in got[1]] == pytest.approx([pair[1] for pair in want[1]],
                                                             abs=1e-4)


def test_grammars_check_drafts_and_constrained_output_is_unchanged(tmp_path_factory):
    model_dir = build_tiny_served_model(tmp_path_factory.mktemp("structured"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = [greedy_request(prompt_of(9 + 13 * i, i), max_tokens=60, request_id=kind,
                            grammars=GRAMMARS[kind]) for i, kind in enumerate(GRAMMARS)]
    plain_core = make_core(model_dir)
    plain = run_to_completion(plain_core, batch)
    core = spec_core(model_dir, plain)
    # Every third draft call ends its first run with EOS, which no grammar allows mid-output.
    core.speculator.source.spoil_with = min(plain_core.eos_token_ids)
    checked = []
    validate = core.speculator._checked

    def recording(request, drafts):
        allowed = validate(request, drafts)
        checked.append((len(drafts), len(allowed)))
        return allowed

    core.speculator._checked = recording
    assert run_to_completion(core, batch) == plain
    assert any(allowed < offered for offered, allowed in checked), "no draft was cut"
    for kind in GRAMMARS:
        assert_conforms(kind, tokenizer.decode(plain[kind]))
    sampled = [AddRequest(f"{kind}-{seed}", prompt_of(12, seed), SamplingParams(
        max_tokens=60, temperature=1.0, seed=seed, grammars=GRAMMARS[kind]), 0.0)
        for kind in GRAMMARS for seed in range(3)]
    ngram = make_core(model_dir, speculative_config=NGRAM)
    for request_id, tokens in run_to_completion(ngram, sampled).items():
        assert_conforms(request_id.split("-")[0], tokenizer.decode(tokens))


def test_batch_invariant_drafts_give_the_same_bits_as_decoding_in_bf16(tiny_model_dir):
    """In --batch-invariant mode a draft's row is computed as a decode row: bf16 greedy
    output with drafts equals the output without, exactly, beside other requests."""
    prompts = [prompt_of(12, 1) * 3, prompt_of(40, 2), prompt_of(7, 3) * 4]
    batch = [greedy_request(p, max_tokens=40, request_id=f"r{i}") for i, p in enumerate(prompts)]
    settings = {"dtype": "bfloat16", "batch_invariant": True}
    plain = run_to_completion(make_core(tiny_model_dir, **settings), batch)
    core = spec_core(tiny_model_dir, plain, **settings)
    assert run_to_completion(core, batch) == plain
    assert core.speculator.totals.num_accepted_tokens > 10


def draft_config(model_dir: str, k: int = 4) -> str:
    return json.dumps({"method": "draft_model", "model": model_dir, "num_speculative_tokens": k})


def test_a_draft_model_equal_to_the_target_has_every_draft_accepted(
        tiny_model_dir, tmp_path_factory):
    """A draft with the target's own weights must propose exactly the target's tokens: any
    draft K/V missing or stale (prompt chunks, accepted drafts, preemption, prefix hits)
    would show as a rejection."""
    twin = build_tiny_llama_dir(tmp_path_factory.mktemp("twin"))  # same seed: same weights
    shared = prompt_of(32, 99)
    prompts = [prompt_of(n, i) for i, n in enumerate([3, 17, 40, 9, 64, 25])]
    prompts += [[*shared, 5], [*shared, 6]]
    batch = [greedy_request(p, max_tokens=30, request_id=f"r{i}") for i, p in enumerate(prompts)]
    settings = {"num_kv_blocks": 12, "max_num_batched_tokens": 48}
    plain = run_to_completion(make_core(tiny_model_dir, **settings), batch)
    core = make_core(tiny_model_dir, speculative_config=draft_config(twin), **settings)
    core.speculator.cost = FixedCost()
    assert run_to_completion(core, batch) == plain
    totals = core.speculator.totals
    assert core.scheduler.num_preemptions >= 1 and core.block_manager.stats.hits > 0
    assert totals.num_draft_tokens > 100
    assert totals.num_accepted_tokens == totals.num_draft_tokens
    assert core.totals.num_steps < len(batch) * 30 // 3


def test_a_draft_model_of_another_architecture_keeps_output_and_shares_the_blocks(
        tiny_model_dir, tmp_path_factory, reference_model):
    draft = build_tiny_llama_dir(tmp_path_factory.mktemp("draft"), "qwen3", seed=5,
                                 num_hidden_layers=1, head_dim=16)
    batch = [greedy_request(prompt_of(n, i), max_tokens=24) for i, n in enumerate([5, 30, 12])]
    plain_core = make_core(tiny_model_dir)
    plain = run_to_completion(plain_core, batch)
    core = make_core(tiny_model_dir, speculative_config=draft_config(draft))
    assert run_to_completion(core, batch) == plain
    assert core.speculator.totals.num_draft_tokens > 0
    # Same memory, fewer blocks: each holds the draft's K/V too (one layer of the target's
    # two, its 2 KV heads of 16 against the target's 2 of 16).
    assert core.block_manager.num_blocks < plain_core.block_manager.num_blocks
    assert_equals_transformers_generate(plain, batch, reference_model)


def kv_bytes_from_config(model_dir: str, block_size: int, dtype_bytes: int) -> int:
    """One block's K and V in every layer, from the checkpoint's config.json."""
    with open(f"{model_dir}/config.json") as file:
        config = json.load(file)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return (config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
            * block_size * 2 * dtype_bytes)


def test_a_draft_models_blocks_are_the_kv_memory_over_both_models_bytes_per_block(
        tiny_model_dir, tmp_path_factory):
    """Every factor of the draft's block differs from the target's (3 layers against 2, one
    KV head against 2, head_dim 32 against 16), so a draft counted with any of the target's
    figures, or not at all, gives another number of blocks; and the tensors both runners
    hold are as large as counted."""
    draft = build_tiny_llama_dir(tmp_path_factory.mktemp("accounted"), "qwen3", seed=3,
                                 num_hidden_layers=3, num_key_value_heads=1, head_dim=32)
    block_size, memory = 8, 1_000_000
    target_bytes = kv_bytes_from_config(tiny_model_dir, block_size, 4)  # fp32
    draft_bytes = kv_bytes_from_config(draft, block_size, 4)
    assert (target_bytes, draft_bytes) == (2 * 2 * 16 * 8 * 2 * 4, 3 * 1 * 32 * 8 * 2 * 4)
    core = make_core(tiny_model_dir, speculative_config=draft_config(draft),
                     block_size=block_size, kv_cache_memory=memory)
    num_blocks = memory // (target_bytes + draft_bytes)
    assert core.block_manager.num_blocks == num_blocks == 97
    assert make_core(tiny_model_dir, block_size=block_size, kv_cache_memory=memory
                     ).block_manager.num_blocks == memory // target_bytes
    for runner, bytes_per_block, num_layers in ((core.runner, target_bytes, 2),
                                                (core.draft_model.runner, draft_bytes, 3)):
        caches = [cache for layer in runner.kv_caches for cache in layer]
        assert len(caches) == 2 * num_layers
        assert all(cache.shape[0] == num_blocks + 1 for cache in caches)  # and the null block
        assert sum(cache[0].numel() * cache.element_size() for cache in caches) == \
            bytes_per_block


def test_a_draft_model_with_a_larger_vocabulary_is_refused(tiny_model_dir, tmp_path_factory):
    draft = build_tiny_llama_dir(tmp_path_factory.mktemp("wide"), vocab_size=512)
    with pytest.raises(ValueError, match="vocabulary"):
        make_core(tiny_model_dir, speculative_config=draft_config(draft))


def test_a_step_that_records_a_tape_is_left_out_of_the_step_cost_table(tiny_model_dir):
    """A drafted shape's first step records its tape, many times what the shape takes from
    then on: timed, it priced its row count out of drafting for good (one stream drafted one
    token a step, whatever its acceptance). Two requests: their drafted shapes are recorded
    on first use."""
    prompts = {"a": prompt_of(12), "b": prompt_of(14, salt=1)}
    requests = [greedy_request(prompt, 24, name) for name, prompt in prompts.items()]
    plain = run_to_completion(make_core(tiny_model_dir), requests)
    core = make_core(tiny_model_dir, speculative_config=NGRAM)
    assert core.runner.tapes is not None, "decode steps run from tapes by default"
    core.speculator.source = OracleDrafts(plain, spoil_every=4)
    observed, recorded, rows = [], [], []
    after_each_call(core.speculator, "observe_step",
                    lambda _, num_rows, seconds: observed.append(num_rows))
    after_each_call(core.scheduler, "schedule", lambda step: rows.append(
        step.num_scheduled_tokens if all(c.is_decode for c in step.chunks) else 0))
    for request in requests:
        core.add_request(request)
    while core.has_work:
        before = core.runner.num_recordings
        core.step()
        recorded.append(core.runner.num_recordings > before)
    drafted = [count for count in rows if count > 2]
    assert len(set(drafted)) >= 2, "drafts of several lengths were verified"
    assert any(recorded), "a drafted shape recorded its tape"
    assert observed == [count for count, new in zip(rows, recorded, strict=True)
                        if count and not new]


def test_one_requests_drafted_steps_are_recorded_when_the_engine_starts(tiny_model_dir):
    prompt = prompt_of(12)
    plain = run_to_completion(make_core(tiny_model_dir), [greedy_request(prompt, 24, "r")])
    core = make_core(tiny_model_dir, speculative_config=NGRAM)
    core.speculator.source = OracleDrafts(plain)
    core.speculator.cost = FixedCost()
    recordings = core.runner.num_recordings
    lengths = set()
    after_each_call(core.scheduler, "schedule", lambda step: lengths.update(
        len(chunk.draft_token_ids) for chunk in step.chunks))
    assert run_to_completion(core, [greedy_request(prompt, 24, "r")]) == plain
    assert len(lengths - {0}) >= 2, "drafts of several lengths were verified"
    assert core.runner.num_recordings == recordings
