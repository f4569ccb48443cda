"""End to end: `launch.py --speculative-config` (n-gram drafts; suffix drafts and a draft
model on servers of their own) on the default model (fp32), real HTTP on 127.0.0.1. A reply
that quotes its prompt is drafted and accepted, and the user sees what an engine without
drafts would send: transformers' greedy text, stop strings cut where they match, logprobs per
token, seeded choices that repeat, JSON that matches its schema; /metrics counts the drafts.
A draft model that cannot be served is refused at launch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.default_model import resolve_model
from tests.launched_server import LaunchedServer

MODEL = "SmolLM2-135M-Instruct"
PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He "
           "trimmed the wick, polished the great lens, and wrote the weather in his log. "
           "Ships passing the rocks saw the beam sweep the water twice each minute.")
QUOTE = [{"role": "user", "content": f"Repeat this text exactly:\n\n{PASSAGE}"}]
MAX_TOKENS = 60
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}

pytestmark = pytest.mark.e2e


def server_of_its_own(tmp_path_factory, speculative: dict, name: str):
    launched = LaunchedServer(["--dtype", "float32", "--speculative-config",
                               json.dumps(speculative)]).start(tmp_path_factory.mktemp(name))
    yield launched
    assert launched.stop() == 0, launched.log


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from server_of_its_own(tmp_path_factory, NGRAM, "logs")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference_text():
    """transformers' greedy text (fp32) of a chat's first MAX_TOKENS tokens: the model loaded
    once, each chat generated once."""
    directory = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    texts: dict[str, str] = {}

    def text(messages: list[dict]) -> str:
        key = json.dumps(messages)
        if key not in texts:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)
            with torch.no_grad():
                output = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(
                    1, len(prompt)), max_new_tokens=MAX_TOKENS, do_sample=False)
            texts[key] = tokenizer.decode(output[0, len(prompt):], skip_special_tokens=True)
        return texts[key]
    return text


def spec_counters(server: LaunchedServer) -> dict[str, float]:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    counters: dict[str, float] = {}
    for name, value in re.findall(r"^loom:(spec_decode_\w+?)_total(?:\{[^}]*\})? (\S+)$",
                                  text, re.M):
        counters[name] = counters.get(name, 0.0) + float(value)
    return counters


def test_a_quoting_reply_streams_transformers_greedy_text_and_counts_its_drafts(
        server, client, reference_text):
    expected = reference_text(QUOTE)
    before = spec_counters(server)  # other tests' requests may have drafted already
    stream = client.chat.completions.create(model=MODEL, messages=QUOTE, temperature=0,
                                            max_tokens=MAX_TOKENS, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS or "lighthouse" in text
    after = spec_counters(server)
    counters = {name: after[name] - before.get(name, 0.0) for name in after}
    assert counters["spec_decode_num_drafts"] > 0
    # How many drafts are verified is the step-cost model's call, learned from every step the
    # server ran before (on a small CPU, earlier tests' steps can leave it drafting only
    # probes); but the drafts of a quoted passage are mostly right, however few.
    assert counters["spec_decode_num_accepted_tokens"] >= \
        0.5 * counters["spec_decode_num_draft_tokens"]
    assert counters["spec_decode_num_accepted_tokens_per_pos"] == \
        counters["spec_decode_num_accepted_tokens"]
    assert counters["spec_decode_num_draft_tokens"] >= counters["spec_decode_num_accepted_tokens"]


def test_a_stop_string_inside_accepted_drafts_ends_the_text_there(client):
    full = client.chat.completions.create(model=MODEL, messages=QUOTE, temperature=0,
                                          max_tokens=MAX_TOKENS).choices[0].message.content
    stop = "polished"
    assert stop in full
    response = client.chat.completions.create(model=MODEL, messages=QUOTE, temperature=0,
                                              max_tokens=MAX_TOKENS, stop=[stop])
    assert response.choices[0].message.content == full[:full.index(stop)]
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens < MAX_TOKENS


def test_logprobs_come_one_per_token_and_seeded_choices_repeat(client):
    response = client.chat.completions.create(model=MODEL, messages=QUOTE, temperature=0,
                                              max_tokens=30, logprobs=True, top_logprobs=2)
    entries = response.choices[0].logprobs.content
    assert "".join(entry.token for entry in entries) == response.choices[0].message.content
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in entries)

    def sampled():
        reply = client.chat.completions.create(model=MODEL, messages=QUOTE, temperature=0.8,
                                               seed=5, n=2, max_tokens=30)
        return [choice.message.content for choice in reply.choices]

    first = sampled()
    assert first == sampled() and first[0] != first[1]


def test_structured_output_matches_its_schema_with_drafts(client):
    schema = {"type": "object", "properties": {"keeper": {"type": "string"},
                                               "stairs": {"enum": ["spiral", "straight"]}},
              "required": ["keeper", "stairs"], "additionalProperties": False}
    response = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=80,
        messages=[{"role": "user", "content": f"{PASSAGE}\n\nAnswer in JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": schema}})
    answer = json.loads(response.choices[0].message.content)
    assert set(answer) == {"keeper", "stairs"} and answer["stairs"] in ("spiral", "straight")


def streamed_greedy_text(server: LaunchedServer, messages: list[dict]) -> str:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                            max_tokens=MAX_TOKENS, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


@pytest.fixture(scope="module")
def suffix_server(tmp_path_factory):
    yield from server_of_its_own(
        tmp_path_factory, {"method": "suffix", "num_speculative_tokens": 8}, "suffix-logs")


def test_suffix_drafts_stream_transformers_greedy_text_and_are_mostly_accepted(
        suffix_server, reference_text):
    """A fresh server's one stream: the quote's tokens followed their contexts in the prompt,
    so drafts of several tokens are verified and mostly accepted."""
    assert streamed_greedy_text(suffix_server, QUOTE) == reference_text(QUOTE)
    counters = spec_counters(suffix_server)
    assert counters["spec_decode_num_accepted_tokens"] >= 0.3 * MAX_TOKENS
    assert counters["spec_decode_num_draft_tokens"] > counters["spec_decode_num_drafts"], \
        "some verifications carried several drafts"


@pytest.fixture(scope="module")
def draft_model_server(tmp_path_factory):
    """The default model drafting for itself: a draft model in the engine beside the target,
    its K/V in the same blocks."""
    yield from server_of_its_own(tmp_path_factory, {
        "method": "draft_model", "model": resolve_model(None), "num_speculative_tokens": 4},
        "draft-model-logs")


def test_a_draft_model_streams_transformers_greedy_text_and_its_twins_drafts_all_pass(
        draft_model_server, reference_text):
    """A reply nothing in its prompt predicts: only a model can draft it. With the target's
    own weights every draft is the target's next token (any stale or missing draft K/V would
    be rejected), and the text is transformers' greedy text."""
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    assert streamed_greedy_text(draft_model_server, messages) == reference_text(messages)
    counters = spec_counters(draft_model_server)
    assert counters["spec_decode_num_draft_tokens"] >= MAX_TOKENS // 2
    assert counters["spec_decode_num_accepted_tokens"] == counters["spec_decode_num_draft_tokens"]
    assert counters["spec_decode_num_draft_tokens"] > counters["spec_decode_num_drafts"], \
        "some verifications carried several drafts"


def test_a_draft_model_that_cannot_be_served_is_refused_at_launch(tmp_path) -> None:
    """The reason, no traceback, before any engine loads the target's weights."""
    config = {"method": "draft_model", "model": str(tmp_path / "absent"),
              "num_speculative_tokens": 3}
    launch = Path(__file__).resolve().parents[1] / "launch.py"
    result = subprocess.run([sys.executable, str(launch), "--host", "127.0.0.1", "--port", "0",
                             "--speculative-config", json.dumps(config)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "the draft model" in result.stderr and str(tmp_path / "absent") in result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "[engine" not in result.stdout + result.stderr  # no engine was started
