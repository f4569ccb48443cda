"""n choices, prompt lists, token-id prompts and echo, against the fake engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from common.protocol import AddRequest
from frontend.choices import SEED_SPAN, sample_seed, total_usage
from frontend.generation import Usage
from frontend.stream_merge import merge
from tests.fake_engine import FrontendHarness
from tests.test_frontend import parse_sse

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]
ANSWERS = ["Hello world!", "The quick brown fox.", "Paris is the capital.", "Stop here."]


def answer_by_choice(harness: FrontendHarness) -> None:
    """Choice i (request id suffix -i) answers ANSWERS[i], then EOS."""
    eos = harness.info.eos_token_ids[0]

    def reply(request: AddRequest) -> list[int]:
        index = int(request.request_id.rsplit("-", 1)[1])
        return [*harness.encode(ANSWERS[index]), eos]

    harness.engine.reply = reply


def echo_prompt(harness: FrontendHarness) -> None:
    """Every request answers its own prompt tokens, then EOS."""
    eos = harness.info.eos_token_ids[0]
    harness.engine.reply = lambda request: [*request.prompt_token_ids, eos]


async def test_completions_n_non_streaming(harness: FrontendHarness) -> None:
    answer_by_choice(harness)
    response = await harness.client.post(
        COMPLETIONS, json={"prompt": "Hi", "n": 3, "seed": 10, "max_tokens": 20}
    )
    assert response.status == 200, await response.text()
    body = await response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == ANSWERS[:3]
    assert all(c["finish_reason"] == "stop" for c in body["choices"])
    adds = harness.engine.adds
    assert [add.request_id for add in adds] == [f"{body['id']}-{i}" for i in range(3)]
    assert [add.sampling.seed for add in adds] == [10, 11, 12]
    assert all(add.sampling.max_tokens == 20 for add in adds)
    prompt_tokens = len(harness.encode("Hi"))
    completion_tokens = sum(len(harness.encode(a)) + 1 for a in ANSWERS[:3])
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == completion_tokens
    assert body["usage"]["total_tokens"] == prompt_tokens + completion_tokens


async def test_unseeded_samples_stay_unseeded(harness: FrontendHarness) -> None:
    answer_by_choice(harness)
    response = await harness.client.post(CHAT, json={"messages": USER, "n": 2})
    assert response.status == 200
    assert [add.sampling.seed for add in harness.engine.adds] == [None, None]


async def test_chat_n_streaming_with_usage(harness: FrontendHarness) -> None:
    answer_by_choice(harness)
    response = await harness.client.post(
        CHAT,
        json={
            "messages": USER,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = parse_sse(await response.text())
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    content_chunks = chunks[:-1]
    assert all(len(c["choices"]) == 1 and c["usage"] is None for c in content_chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in content_chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant" and mine[0]["delta"]["content"]
        assert all("role" not in choice["delta"] for choice in mine[1:])
        assert "".join(choice["delta"].get("content", "") for choice in mine) == ANSWERS[index]
        assert [choice["finish_reason"] for choice in mine][-1] == "stop"
        assert all(choice["finish_reason"] is None for choice in mine[:-1])
    completion_tokens = sum(len(harness.encode(a)) + 1 for a in ANSWERS[:2])
    assert usage_chunk["usage"]["completion_tokens"] == completion_tokens
    assert usage_chunk["usage"]["prompt_tokens"] == len(harness.engine.adds[0].prompt_token_ids)


async def test_stream_chunks_interleave_choices(harness: FrontendHarness) -> None:
    answer_by_choice(harness)
    response = await harness.client.post(
        COMPLETIONS, json={"prompt": "Hi", "n": 2, "stream": True}
    )
    indices = [c["choices"][0]["index"] for c in parse_sse(await response.text())]
    first_of_one = indices.index(1)
    assert 0 in indices[first_of_one:], "choices stream side by side, not one after another"


async def test_prompt_list_gives_n_choices_per_prompt(harness: FrontendHarness) -> None:
    echo_prompt(harness)
    prompts = ["Hello world!", "The quick brown fox."]
    response = await harness.client.post(COMPLETIONS, json={"prompt": prompts, "n": 2})
    body = await response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [prompts[0]] * 2 + [prompts[1]] * 2
    assert body["usage"]["prompt_tokens"] == sum(len(harness.encode(p)) for p in prompts)


async def test_token_id_prompts(harness: FrontendHarness) -> None:
    echo_prompt(harness)
    single = harness.encode("Hello world!")
    response = await harness.client.post(COMPLETIONS, json={"prompt": single})
    assert (await response.json())["choices"][0]["text"] == "Hello world!"
    several = [harness.encode("Stop here."), harness.encode("Paris")]
    response = await harness.client.post(COMPLETIONS, json={"prompt": several, "max_tokens": 9})
    body = await response.json()
    assert [c["text"] for c in body["choices"]] == ["Stop here.", "Paris"]
    assert [add.prompt_token_ids for add in harness.engine.adds[1:]] == several


async def test_each_prompt_must_fit_the_context(harness: FrontendHarness) -> None:
    response = await harness.client.post(COMPLETIONS, json={"prompt": [[5, 6], [5] * 300]})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["code"] == "context_length_exceeded" and "300" in error["message"]
    assert harness.engine.adds == []


async def test_echo_non_streaming(harness: FrontendHarness) -> None:
    harness.reply_with(" Paris.")
    response = await harness.client.post(
        COMPLETIONS, json={"prompt": ["Hello world!", "Stop"], "echo": True, "n": 2}
    )
    texts = [c["text"] for c in (await response.json())["choices"]]
    assert texts == ["Hello world! Paris."] * 2 + ["Stop Paris."] * 2
    response = await harness.client.post(
        COMPLETIONS, json={"prompt": harness.encode("The fox"), "echo": True}
    )
    assert (await response.json())["choices"][0]["text"] == "The fox Paris."


async def test_echo_streaming(harness: FrontendHarness) -> None:
    harness.reply_with(" Paris.")
    response = await harness.client.post(
        COMPLETIONS, json={"prompt": "Hello world!", "echo": True, "stream": True}
    )
    chunks = parse_sse(await response.text())
    first = chunks[0]["choices"][0]["text"]
    assert first.startswith("Hello world!") and len(first) > len("Hello world!"), (
        "the echo rides on the first token's chunk")
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello world! Paris."


async def test_stop_string_ends_every_choice(harness: FrontendHarness) -> None:
    harness.reply_with("Hello world! The capital", eos=False)
    response = await harness.client.post(
        COMPLETIONS, json={"prompt": "Hi", "n": 3, "stop": "world", "max_tokens": 50}
    )
    body = await response.json()
    assert [c["text"] for c in body["choices"]] == ["Hello "] * 3
    assert [c["finish_reason"] for c in body["choices"]] == ["stop"] * 3
    ids = [f"{body['id']}-{i}" for i in range(3)]
    await harness.engine.wait_for(lambda: set(ids) <= set(harness.engine.aborted))


async def test_one_refused_choice_fails_the_request_and_aborts_the_rest(
    harness: FrontendHarness,
) -> None:
    harness.reply_with("Hello world!", eos=False)
    harness.engine.step_interval_s = 0.01
    harness.engine.refuse = lambda r: "no room" if r.request_id.endswith("-1") else None
    response = await harness.client.post(
        COMPLETIONS, json={"prompt": "Hi", "n": 3, "max_tokens": 200}
    )
    assert response.status == 400
    assert "no room" in (await response.json())["error"]["message"]
    others = [add.request_id for add in harness.engine.adds if not add.request_id.endswith("-1")]
    await harness.engine.wait_for(lambda: set(others) <= set(harness.engine.aborted))
    await harness.engine.wait_for(lambda: harness.engine.num_running == 0)


async def test_client_disconnect_aborts_every_choice(harness: FrontendHarness) -> None:
    harness.reply_with("Hello world!", eos=False)
    harness.engine.step_interval_s = 0.01
    response = await harness.client.post(
        CHAT, json={"messages": USER, "n": 4, "stream": True, "max_tokens": 200}
    )
    await response.content.readuntil(b"\n\n")
    await harness.engine.wait_for(lambda: harness.engine.num_running == 4)
    response.close()
    ids = [add.request_id for add in harness.engine.adds]
    await harness.engine.wait_for(lambda: set(ids) <= set(harness.engine.aborted))


def test_sample_seeds() -> None:
    assert sample_seed(None, 3) is None
    assert [sample_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert sample_seed(-1, 1) == 0
    assert sample_seed(SEED_SPAN - 1, 2) == 1


def test_total_usage_counts_each_prompt_once() -> None:
    usages = [Usage(5, 3, 0), Usage(5, 4, 5), Usage(7, 1, 2), Usage(7, 2, 7)]
    total = total_usage(usages, n=2)
    assert (total.prompt_tokens, total.completion_tokens, total.cached_tokens) == (12, 10, 2)


async def ticker(name: str, delays: list[float], fail: bool = False) -> AsyncIterator[str]:
    for step, delay in enumerate(delays):
        await asyncio.sleep(delay)
        yield f"{name}{step}"
    if fail:
        raise RuntimeError(f"{name} failed")


async def test_merge_yields_items_as_they_come() -> None:
    merged = [
        item async for item in merge([ticker("a", [0.03, 0.03]), ticker("b", [0.01, 0.01])])
    ]
    assert merged == [(1, "b0"), (1, "b1"), (0, "a0"), (0, "a1")]


async def test_merge_fails_with_the_first_error_and_cancels_the_rest() -> None:
    cancelled = asyncio.Event()

    async def endless() -> AsyncIterator[str]:
        try:
            while True:
                await asyncio.sleep(0.01)
                yield "tick"
        finally:
            cancelled.set()

    with pytest.raises(RuntimeError, match="b failed"):
        async for _ in merge([endless(), ticker("b", [0.02], fail=True)]):
            pass
    await asyncio.wait_for(cancelled.wait(), 1)
