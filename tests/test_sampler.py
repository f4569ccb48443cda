"""Sampling parameters, table-driven, each against a reference computed here independently."""

from __future__ import annotations

import math

import pytest
import torch

from common.sampling import SamplingParams
from engine.kernels.sampling import load_sampling
from engine.request import Request
from engine.sampling import sampler as sampler_module
from engine.sampling.logits_processors import process_logits
from engine.sampling.sampler import Sampler, first_max_index, greedy_tokens

EOS = 0
VOCAB = 12
# A fixed logits vector with distinct values: token 5 is the argmax.
LOGITS = torch.tensor([1.0, -0.5, 2.0, 0.3, -1.2, 3.1, 0.0, 2.6, -2.0, 1.4, 0.8, -0.1])


def request(output: list[int] | None = None, prompt: list[int] | None = None,
            **params) -> Request:
    made = Request("r", prompt or [3, 4], SamplingParams(max_tokens=50, **params))
    for token in output or []:
        made.append_token(token)
    return made


def draw_many(params: dict, draws: int = 400, logits: torch.Tensor = LOGITS) -> list[int]:
    sampler = Sampler(torch.device("cpu"), seed=1)
    rows = [request(**params) for _ in range(draws)]
    for index, row in enumerate(rows):
        row.request_id = f"r{index}"
    batch = logits.expand(draws, -1).clone()
    return sampler.sample(batch, rows, frozenset([EOS])).token_ids


def sample_many(params: dict, draws: int = 400, logits: torch.Tensor = LOGITS) -> set[int]:
    return set(draw_many(params, draws, logits))


@pytest.fixture(params=["C++", "torch"])
def sampling_path(request, monkeypatch) -> str:
    """Every test that takes it runs on the CPU kernel and on the torch path (the one other
    devices take)."""
    if request.param == "torch":
        monkeypatch.setattr(sampler_module, "load_sampling", lambda: None)
    elif load_sampling() is None:
        pytest.skip("the C++ sampling kernel does not build here")
    return request.param


def probabilities(logits: torch.Tensor) -> list[float]:
    exps = [math.exp(v) for v in logits.tolist()]
    return [e / sum(exps) for e in exps]


def top_p_support(logits: torch.Tensor, top_p: float) -> set[int]:
    probs = probabilities(logits)
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for token in order:
        if mass >= top_p:
            break
        kept.add(token)
        mass += probs[token]
    return kept


def ranked(logits: torch.Tensor) -> list[int]:
    return sorted(range(len(logits)), key=lambda i: -float(logits[i]))


@pytest.mark.parametrize(
    ("params", "expected_support"),
    [
        ({"temperature": 0.0}, {5}),
        ({"temperature": 1.0, "top_k": 1}, {5}),
        ({"temperature": 1.0, "top_k": 3}, set(ranked(LOGITS)[:3])),
        ({"temperature": 1.0, "top_p": 0.5}, top_p_support(LOGITS, 0.5)),
        ({"temperature": 1.0, "top_p": 0.8}, top_p_support(LOGITS, 0.8)),
        ({"temperature": 1.0, "top_k": 4, "top_p": 0.99},
         set(ranked(LOGITS)[:4])),
        ({"temperature": 1.0, "min_p": 0.3},
         {i for i, p in enumerate(probabilities(LOGITS))
          if p >= 0.3 * max(probabilities(LOGITS))}),
        ({"temperature": 0.0, "logit_bias": {8: 100.0}}, {8}),
        ({"temperature": 1.0, "logit_bias": {8: 100.0}}, {8}),
        ({"temperature": 1.0, "logit_bias": {t: -100.0 for t in range(VOCAB) if t != 4}}, {4}),
    ],
    ids=["greedy", "top_k=1", "top_k=3", "top_p=0.5", "top_p=0.8", "top_k+top_p", "min_p",
         "bias-greedy", "bias-sampled", "bias-ban-all-but-one"],
)
def test_sampled_tokens_stay_in_the_reference_support(params, expected_support,
                                                     sampling_path):
    assert sample_many(params) <= expected_support
    if len(expected_support) > 1:
        assert len(sample_many(params)) > 1  # it really samples


def test_top_k_one_equals_greedy_on_random_rows(sampling_path):
    torch.manual_seed(0)
    logits = torch.randn(32, 1000)
    rows = [request(temperature=0.9, top_k=1) for _ in range(32)]
    for index, row in enumerate(rows):
        row.request_id = f"r{index}"
    sampled = Sampler(torch.device("cpu")).sample(logits, rows, frozenset()).token_ids
    assert sampled == logits.argmax(dim=-1).tolist()


def test_penalties_follow_the_documented_formula():
    prompt, output = [2, 3], [5, 5, 7]
    params = {"repetition_penalty": 1.5, "presence_penalty": 0.4, "frequency_penalty": 0.3}
    edited = process_logits(LOGITS[None].clone(), [request(output, prompt, **params)],
                            frozenset())[0]
    expected = LOGITS.clone()
    for token in set(prompt + output):  # repetition: prompt and output
        value = float(expected[token])
        expected[token] = value / 1.5 if value > 0 else value * 1.5
    for token in set(output):  # frequency and presence: output only
        expected[token] -= 0.3 * output.count(token) + 0.4
    assert torch.allclose(edited, expected)


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached():
    logits = LOGITS.clone()
    logits[EOS] = 50.0
    logits[9] = 40.0
    early = request(output=[1], min_tokens=3, temperature=0.0, stop_token_ids=[9])
    late = request(output=[1, 1, 1], min_tokens=3, temperature=0.0, stop_token_ids=[9])
    sampler = Sampler(torch.device("cpu"))
    assert sampler.sample(logits[None].clone(), [early], frozenset([EOS])).token_ids == [5]
    assert sampler.sample(logits[None].clone(), [late], frozenset([EOS])).token_ids == [EOS]


def test_ignore_eos_keeps_eos_sampleable_but_not_stopping():
    logits = LOGITS.clone()
    logits[EOS] = 50.0
    ignoring = request(output=[1], min_tokens=3, ignore_eos=True, temperature=0.0)
    assert Sampler(torch.device("cpu")).sample(
        logits[None], [ignoring], frozenset([EOS])).token_ids == [EOS]


def test_logprobs_are_the_models_log_softmax():
    row = request(temperature=0.0, logprobs=3)
    result = Sampler(torch.device("cpu")).sample(LOGITS[None].clone(), [row], frozenset())
    chosen, top = result.logprobs[0]
    reference = [math.log(p) for p in probabilities(LOGITS)]
    assert chosen == pytest.approx(reference[5], abs=1e-5)
    assert [token for token, _ in top] == ranked(LOGITS)[:3]
    assert [value for _, value in top] == pytest.approx(
        [reference[t] for t in ranked(LOGITS)[:3]], abs=1e-5)
    plain = Sampler(torch.device("cpu")).sample(LOGITS[None].clone(), [request()], frozenset())
    assert plain.logprobs == [None]


def test_a_seeded_request_samples_the_same_alone_or_in_a_batch(sampling_path):
    torch.manual_seed(0)
    vocab = 500
    steps = [torch.randn(vocab) for _ in range(10)]

    def run(batch_size: int) -> list[int]:
        sampler = Sampler(torch.device("cpu"), seed=123)
        seeded = request(temperature=1.0, seed=42)
        others = [request(temperature=1.0) for _ in range(batch_size - 1)]
        for index, other in enumerate(others):
            other.request_id = f"other-{index}"
        tokens = []
        for logits in steps:
            rows = [*others[:len(others) // 2], seeded, *others[len(others) // 2:]]
            batch = torch.stack([logits] + [torch.randn(vocab) for _ in others])
            batch = torch.cat([batch[1:1 + len(others) // 2], batch[:1],
                               batch[1 + len(others) // 2:]])
            result = sampler.sample(batch, rows, frozenset())
            tokens.append(result.token_ids[len(others) // 2])
        return tokens

    alone = run(1)
    assert alone == run(16)
    assert len(set(alone)) > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [1, 15, 16, 17, 49152, 49157])
def test_greedy_rows_take_their_first_maximum_as_they_are(dtype: torch.dtype,
                                                          width: int) -> None:
    """The C++ argmax over raw rows equals torch's first-maximum rule, ties included (bf16
    rounding makes many), in the vector body and the scalar tail."""
    torch.manual_seed(width)
    rows = (torch.randn(9, width) * 3).to(dtype)
    rows[1] = 0.0  # all tied: index 0
    if width > 1:
        rows[2, -1] = 1e4  # the maximum in the tail (when width % 16)
        rows[3, :] = -5.0
        rows[3, width // 2] = rows[3, width - 1] = 7.0  # two maxima: the first wins
    want = rows.float().max(dim=-1).indices
    assert torch.equal(greedy_tokens(rows), want)
    assert torch.equal(greedy_tokens(rows[:, :]), first_max_index(rows.float()))


def test_greedy_rows_of_a_strided_view_are_read_in_place() -> None:
    wide = torch.randn(4, 100)
    view = wide[:, :64]  # rows 100 apart
    assert torch.equal(greedy_tokens(view), view.max(dim=-1).indices)


def test_plain_batches_skip_the_float32_copy_and_others_do_not() -> None:
    """Greedy and plain random rows (temperature, top_k, top_p, min_p) read the output
    projection's own logits; edits and logprobs need float32."""
    sampler = Sampler(torch.device("cpu"), seed=1)
    plain = [request(temperature=0.0), request(temperature=0.0)]
    assert sampler.takes_raw_logits(plain)
    assert sampler.takes_raw_logits([*plain, request(temperature=0.8, top_p=0.9, top_k=20,
                                                     min_p=0.05)])
    for params in ({"temperature": 1.0, "logprobs": 0}, {"temperature": 0.0, "logprobs": 2},
                   {"temperature": 0.0, "logit_bias": {3: 5.0}},
                   {"temperature": 0.0, "repetition_penalty": 1.2},
                   {"temperature": 0.0, "min_tokens": 3}):
        assert not sampler.takes_raw_logits([*plain, request(**params)]), params
    raw = LOGITS.expand(2, -1).to(torch.bfloat16)
    assert sampler.sample(raw, plain, frozenset([EOS])).token_ids == [5, 5]
    # A bf16 batch that needs edits is widened first, never edited in bf16.
    biased = [request(temperature=0.0, logit_bias={8: 100.0}), request(temperature=0.0)]
    assert sampler.sample(raw, biased, frozenset([EOS])).token_ids == [8, 5]


def filtered_probabilities(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                           min_p: float) -> torch.Tensor:
    """The distribution a row's filters leave, computed here in float64 from the
    definitions: min_p, then top_k, then the smallest top_p prefix of what is left."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
    order = sorted(range(len(probs)), key=lambda i: (-float(probs[i]), i))
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(float(probs[i]) for i in kept)
    prefix, before = [], 0.0
    for token in kept:
        if before >= top_p * mass:
            break
        prefix.append(token)
        before += float(probs[token])
    result = torch.zeros_like(probs)
    result[prefix] = probs[prefix]
    return result / result.sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), [
    (1.0, 0, 1.0, 0.0), (0.6, 0, 1.0, 0.0), (1.3, 40, 1.0, 0.0), (1.0, 0, 0.7, 0.0),
    (0.8, 30, 0.9, 0.0), (1.0, 0, 1.0, 0.05), (0.7, 50, 0.95, 0.01),
], ids=["T=1", "T=0.6", "top_k", "top_p", "top_k+top_p", "min_p", "all"])
def test_random_rows_follow_their_filtered_distribution(sampling_path, dtype, temperature,
                                                        top_k, top_p, min_p) -> None:
    """20,000 draws over a 1,000-token vocabulary (its logits' scale like a model's, no two
    alike even in bf16: ties order as each path likes): the support is exactly the filters'
    and the frequencies match the probabilities within a total variation that chance alone
    exceeds with probability < 1e-4."""
    generator = torch.Generator().manual_seed(3)
    pool = torch.unique((torch.randn(20_000, generator=generator) * 3).bfloat16().float())
    logits = pool[torch.randperm(len(pool), generator=generator)[:1000]].to(dtype)
    draws = 20_000
    tokens = draw_many({"temperature": temperature, "top_k": top_k, "top_p": top_p,
                        "min_p": min_p}, draws, logits)
    want = filtered_probabilities(logits.float(), temperature, top_k, top_p, min_p)
    seen = torch.bincount(torch.tensor(tokens), minlength=len(want)).double() / draws
    assert set(tokens) <= set(want.nonzero().flatten().tolist())
    support = int((want > 0).sum())
    # E[TV] <= sqrt(support / draws) / 2; its deviation is bounded by McDiarmid's inequality
    bound = 0.5 * math.sqrt(support / draws) + math.sqrt(math.log(1e4) / (2 * draws))
    assert 0.5 * float((seen - want).abs().sum()) < bound


def test_penalties_of_a_batch_touch_each_rows_own_tokens() -> None:
    """Rows with different penalties, tokens seen in the prompt and the output both (the
    repetition penalty applies once), repeated outputs (frequency counts them), a row with
    presence alone and one with none, against the formula applied here token by token."""
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 50, generator=generator) * 3
    rows = [
        request([5, 5, 7, 9], [5, 9, 11, 11], repetition_penalty=1.3, frequency_penalty=0.2),
        request([1, 2, 2], [30, 31], presence_penalty=0.7),
        request([4], [4, 6], temperature=0.0),
        request([], [40, 41, 40], repetition_penalty=0.8, presence_penalty=-0.5,
                frequency_penalty=0.1),
    ]
    expected = logits.clone()
    for row, made in enumerate(rows):
        params, output = made.sampling, made.token_ids[made.num_prompt_tokens:]
        seen = set(made.prompt_token_ids) | set(output) \
            if params.repetition_penalty != 1.0 else set(output)
        for token in seen:
            value = float(expected[row, token])
            penalty = params.repetition_penalty
            value = value / penalty if value > 0 else value * penalty
            count = output.count(token)
            expected[row, token] = value - params.frequency_penalty * count \
                - (params.presence_penalty if count else 0.0)
    edited = process_logits(logits.clone(), rows, frozenset())
    assert torch.allclose(edited, expected, atol=1e-6)
    assert torch.equal(edited[2], logits[2])
