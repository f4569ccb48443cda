"""Constrained decoding in the engine (engine.sampling.grammar) on a tiny random Llama that speaks
through SmolLM2's tokenizer: the grammar holds whatever else shares the batch, preemption
included; a request waits for its grammar without a seat; aborts and bad grammars free
everything and leave the engine serving."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from bench.structured import slow_grammar
from common.protocol import AddRequest, FinishReason
from common.sampling import SamplingParams
from engine.scheduler import RequestRefused
from frontend.structured_outputs import StructuredOutput, build_grammars
from tests.engine_helpers import (
    assert_no_leaks,
    greedy_request,
    make_core,
    run_to_completion,
)
from tests.tiny_server import build_tiny_served_model

PHONE = r"[0-9]{3}-[0-9]{4}"
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "size", "ok"],
    "additionalProperties": False,
}
CHOICES = ["alpha", "beta", "gamma delta"]


def grammar(kind: str, spec) -> list[str]:
    return build_grammars(StructuredOutput(kind, kind, spec))


GRAMMARS = {"regex": grammar("regex", PHONE), "json": grammar("json", SCHEMA),
            "choice": grammar("choice", CHOICES)}


def assert_conforms(kind: str, text: str) -> None:
    if kind == "regex":
        assert re.fullmatch(PHONE, text), text
    elif kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert text in CHOICES


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_served_model(tmp_path_factory.mktemp("structured"))


@pytest.fixture(scope="module")
def tokenizer(model_dir: str):
    return AutoTokenizer.from_pretrained(model_dir)


def prompt_of(length: int, seed: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 40000 + 100 for i in range(length)]


def constrained(kind: str, prompt: list[int], request_id: str, **sampling) -> AddRequest:
    return greedy_request(prompt, max_tokens=60, request_id=request_id,
                          grammars=GRAMMARS[kind], **sampling)


def test_constrained_rows_hold_their_grammar_beside_others_with_preemption(
        model_dir: str, tokenizer) -> None:
    prompts = {f"{kind}-{i}": prompt_of(9 + 13 * i, i) for i, kind in enumerate(GRAMMARS)}
    batch = [constrained(request_id.split("-")[0], prompt, request_id)
             for request_id, prompt in prompts.items()]
    batch += [greedy_request(prompt_of(40 + 5 * i, 10 + i), max_tokens=40,
                             request_id=f"free-{i}") for i in range(5)]
    # 12 blocks of 16 tokens for 8 requests of up to 100 tokens: preemption is certain.
    core = make_core(model_dir, num_kv_blocks=12, max_num_batched_tokens=48)
    reasons: dict[str, str] = {}
    together = run_to_completion(core, batch, finish_reasons=reasons)
    assert core.scheduler.num_preemptions >= 1
    assert core.grammars.num_built == len({text for texts in GRAMMARS.values() for text in texts})
    for request_id, prompt in prompts.items():
        kind = request_id.split("-")[0]
        text = tokenizer.decode(together[request_id])
        assert_conforms(kind, text)
        assert reasons[request_id] == FinishReason.STOP
        alone = run_to_completion(make_core(model_dir), [constrained(kind, prompt, "alone")])
        assert together[request_id] == alone["alone"]
    assert all(reasons[f"free-{i}"] == FinishReason.LENGTH for i in range(5))


def test_sampled_constrained_choices_all_conform(model_dir: str, tokenizer) -> None:
    """temperature 1, top_p, penalties and logit_bias on the grammar's rows, several seeds."""
    core = make_core(model_dir)
    requests = [
        AddRequest(f"s-{kind}-{seed}", prompt_of(12, seed), SamplingParams(
            max_tokens=80, temperature=1.0, top_p=0.95, seed=seed, presence_penalty=0.5,
            logit_bias={15: 5.0}, grammars=GRAMMARS[kind]), 0.0)
        for kind in GRAMMARS for seed in range(4)
    ]
    outputs = run_to_completion(core, requests)
    for request in requests:
        assert_conforms(request.request_id.split("-")[1], tokenizer.decode(
            outputs[request.request_id]))


def test_a_request_waits_for_its_grammar_without_a_seat_and_an_abort_frees_it(
        model_dir: str) -> None:
    core = make_core(model_dir, num_kv_blocks=16)
    slow = grammar("grammar", slow_grammar(20_000))
    core.add_request(greedy_request(prompt_of(20, 1), 8, "waits", grammars=slow))
    free = greedy_request(prompt_of(20, 2), 8, "free")
    core.add_request(free)
    assert core.num_awaiting_grammar == 1 and set(core.scheduler.requests) == {"free"}
    assert core.idle_outputs().stats.num_waiting == 2  # both count as waiting
    with pytest.raises(RequestRefused, match="already in use"):  # constrained or not
        core.add_request(greedy_request(prompt_of(5, 3), 8, "waits"))
    core.abort_requests(["waits"])
    assert core.num_awaiting_grammar == 0
    core.abort_requests(["free"])
    assert len(run_to_completion(core, [free])["free"]) == 8
    assert core.admit_constrained() == [] and not core.has_work
    assert_no_leaks(core)


def test_a_grammar_slower_than_the_time_limit_fails_its_request_only(model_dir: str) -> None:
    core = make_core(model_dir, grammar_compile_timeout=0.2)
    core.add_request(greedy_request(prompt_of(10, 3), 8, "slow",
                                    grammars=grammar("grammar", slow_grammar(30_000))))
    core.add_request(greedy_request(prompt_of(10, 4), 8, "free"))
    errors, generated = [], 0
    while core.has_work or core.num_awaiting_grammar:
        errors += core.admit_constrained()
        if core.has_work:
            generated += sum(len(output.new_token_ids) for output in core.step().outputs)
    assert generated == 8
    assert [error.request_id for error in errors] == ["slow"]
    assert "more than 0.2 s to compile" in errors[0].reason
    assert_no_leaks(core)


@pytest.mark.parametrize("bad", ["not a grammar", '{"grammars": [{"lark_grammar": "start: x"}]}'])
def test_a_grammar_the_engine_cannot_build_fails_its_request_only(model_dir: str,
                                                                   bad: str) -> None:
    """What no frontend sends, but a frame may carry: the engine answers with an error."""
    core = make_core(model_dir)
    core.add_request(greedy_request(prompt_of(10, 5), 8, "bad", grammars=[bad]))
    core.grammars.submit(bad).future.exception(timeout=60)
    errors = core.admit_constrained()
    assert [error.request_id for error in errors] == ["bad"]
    assert "grammar" in errors[0].reason
    outputs = run_to_completion(core, [constrained("regex", prompt_of(10, 6), "good")])
    assert re.fullmatch(PHONE, AutoTokenizer.from_pretrained(model_dir).decode(outputs["good"]))


def test_equal_grammars_are_built_once(model_dir: str) -> None:
    core = make_core(model_dir)
    run_to_completion(core, [constrained("json", prompt_of(8 + i, i), f"j{i}") for i in range(4)])
    assert core.grammars.num_built == len(GRAMMARS["json"]) == 2  # the schema and its numbers


def test_mask_leaves_only_the_grammars_tokens_and_unconstrained_rows_alone(
        model_dir: str, tokenizer) -> None:
    from engine.sampling.grammar import Constraint, GrammarCompiler, mask_logits

    compiler = GrammarCompiler(model_dir, 49152, frozenset({2}))
    (choice,) = grammar("choice", ["yes", "no"])
    matcher = compiler.submit(choice).future.result(timeout=60)
    logits = torch.randn(3, 49152)
    masked = mask_logits(logits.clone(), [Constraint([matcher]), None,
                                          Constraint([matcher.deep_copy()])])
    assert torch.equal(masked[1], logits[1])
    for row in (0, 2):
        allowed = torch.isfinite(masked[row]).nonzero().flatten().tolist()
        texts = {tokenizer.decode([token]) for token in allowed}
        assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
        assert torch.equal(masked[row][allowed], logits[row][allowed])
    compiler.close()


def test_every_grammar_of_a_request_holds_at_once(model_dir: str, tokenizer) -> None:
    """Two regexes whose intersection is narrower than either: only tokens both allow."""
    both = grammar("regex", "[a-c]{1,6}") + grammar("regex", "[b-d]{2,4}")
    requests = [AddRequest(f"both-{seed}", prompt_of(12, seed), SamplingParams(
        max_tokens=20, temperature=1.0, seed=seed, grammars=both), 0.0) for seed in range(6)]
    reasons: dict[str, str] = {}
    outputs = run_to_completion(make_core(model_dir), requests, finish_reasons=reasons)
    texts = {tokenizer.decode(outputs[request.request_id], skip_special_tokens=True)
             for request in requests}
    assert all(re.fullmatch("[bc]{2,4}", text) for text in texts), texts
    assert set(reasons.values()) == {FinishReason.STOP}


NUMBERS = {"type": "object", "properties": {"count": {"type": "integer"},
                                            "ratio": {"type": "number"}},
           "required": ["count", "ratio"], "additionalProperties": False}


@pytest.mark.parametrize("spec", [NUMBERS, {"type": "array", "items": {"type": "number"}}],
                         ids=["object", "array"])
def test_numbers_end_even_when_digits_are_favoured(model_dir: str, tokenizer, spec) -> None:
    """logit_bias pushes every digit up: an unbounded integer would run to max_tokens; the
    bound grammar ends an integer at 19 digits and a number at 17 significant ones (an
    array may still run on, number after bounded number)."""
    digits = {tokenizer.convert_tokens_to_ids(str(digit)): 12.0 for digit in range(10)}
    requests = [AddRequest(f"n-{seed}", prompt_of(10, seed), SamplingParams(
        max_tokens=200, temperature=1.0, seed=seed, logit_bias=digits,
        grammars=grammar("json", spec)), 0.0) for seed in range(4)]
    reasons: dict[str, str] = {}
    outputs = run_to_completion(make_core(model_dir), requests, finish_reasons=reasons)
    numbers = []
    for request in requests:
        text = tokenizer.decode(outputs[request.request_id], skip_special_tokens=True)
        numbers += re.findall(r"-?[0-9][0-9.eE+-]*", re.sub(r'"(\\.|[^"\\])*"', '""', text))
        if spec is NUMBERS:
            assert reasons[request.request_id] == FinishReason.STOP, text
            jsonschema.validate(json.loads(text), NUMBERS)
    assert numbers
    for number in numbers:
        mantissa = re.split("[eE]", number.lstrip("-"))[0]
        if mantissa == number.lstrip("-"):  # an integer
            assert len(mantissa) <= 19, number
        else:
            assert len(mantissa.replace(".", "").lstrip("0")) <= 17, number
