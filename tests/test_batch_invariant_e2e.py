"""End to end on the default model. `launch.py --batch-invariant`: 20 seeded prompts at
temperature 1 give the same text each alone, again on their prefix-cache hits all at once, and
beside 24 other requests on a KV cache small enough to preempt some of them (16 tokens an
answer). The default configuration: 20 greedy prompts give the same text cold and on the cache
they filled."""

from __future__ import annotations

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.launched_server import LaunchedServer

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["rivers", "bread", "comets", "chess", "bees", "glass", "tides", "maps", "violins",
          "deserts", "coral", "trains", "ink", "owls", "volcanoes", "salt", "kites", "moss",
          "lighthouses", "clocks"]
PROMPTS = [f"Write two sentences about {topic}." for topic in TOPICS]
OTHERS = [f"List three facts about the number {n}." for n in range(24)]
MAX_TOKENS = 16

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    # 40 blocks of 16 tokens: a prompt and its answer need ~5, so 44 at once preempt.
    launched = LaunchedServer(["--batch-invariant", "--num-kv-blocks", "40"]).start(
        tmp_path_factory.mktemp("logs"))
    yield launched
    assert launched.stop() == 0, launched.log


def ask(client: openai.OpenAI, prompt: str, seed: int) -> str:
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=1.0,
        seed=seed, max_tokens=MAX_TOKENS)
    return response.choices[0].message.content


def preemptions(server: LaunchedServer) -> float:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(float(value) for value in
               re.findall(r"^loom:num_preemptions_total(?:\{[^}]*\})? (\S+)$", text, re.M))


def test_seeded_answers_do_not_depend_on_what_shares_the_steps(server: LaunchedServer) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    alone = [ask(client, prompt, seed) for seed, prompt in enumerate(PROMPTS)]
    assert len(set(alone)) == len(alone)  # sampled text, not one canned reply
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all at once: batched cache hits
        cached = list(pool.map(lambda job: ask(client, job[1], job[0]), enumerate(PROMPTS)))
    assert cached == alone, "a prefix-cache hit beside others changed an answer"

    before = preemptions(server)
    jobs = [(prompt, seed) for seed, prompt in enumerate(PROMPTS)]
    jobs += [(prompt, 1000 + n) for n, prompt in enumerate(OTHERS)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: ask(client, *job), jobs))
    assert preemptions(server) > before, "the small cache preempted nobody"
    assert together[:len(PROMPTS)] == alone, "answers changed beside 24 other requests"


def test_by_default_a_prefix_hit_does_not_change_a_greedy_answer(
    default_server: LaunchedServer,
) -> None:
    client = openai.OpenAI(base_url=default_server.base_url + "/v1", api_key="unused",
                           max_retries=0)

    def greedy(prompt: str) -> str:
        response = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
            max_tokens=MAX_TOKENS)
        return response.choices[0].message.content

    cold = [greedy(prompt) for prompt in PROMPTS]
    cached = [greedy(prompt) for prompt in PROMPTS]
    assert cached == cold


def generated_by_engine(server: LaunchedServer) -> dict[str, float]:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {engine: float(value) for engine, value in re.findall(
        r'^loom:engine_generation_tokens_total\{engine="(\d+)"\} (\S+)$', text, re.M)}


def answer_with_logprobs(client: openai.OpenAI, prompt: str, seed: int) -> list:
    """Each token with its top 5 log-probabilities: float32 values of the logits' own
    log-softmax, exact in JSON, so equal lists mean equal logits' top of the distribution."""
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=1.0,
        seed=seed, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=5)
    return [(token.token, token.logprob, [(top.token, top.logprob) for top in token.top_logprobs])
            for token in response.choices[0].logprobs.content]


def test_two_data_parallel_replicas_give_the_same_answers(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Each replica on its own core (one thread each), requests dealt round robin: every
    seeded prompt answered by both replicas, the same tokens and log-probabilities from each."""
    launched = LaunchedServer(["--batch-invariant", "--data-parallel-size", "2",
                               "--routing-policy", "round_robin"])
    with launched.start(tmp_path_factory.mktemp("dp-logs")):
        client = openai.OpenAI(base_url=launched.base_url + "/v1", api_key="unused",
                               max_retries=0)
        for seed, prompt in enumerate(PROMPTS[:4]):
            first = answer_with_logprobs(client, prompt, seed)
            assert answer_with_logprobs(client, prompt, seed) == first, prompt
        served = generated_by_engine(launched)
        assert set(served) == {"0", "1"} and min(served.values()) > 0, served
