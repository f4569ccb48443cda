"""OpenAI API parity through the official openai SDK (sync and async clients), against
one server started by launch.py on the default model (SmolLM2, float32)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.launched_server import LaunchedServer

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
SAMPLED = {"temperature": 1.0, "top_p": 0.95}  # seeded tests sample for real
NO_EOS = {"ignore_eos": True}

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(float32_default_server: LaunchedServer) -> LaunchedServer:
    return float32_default_server


@pytest.fixture(scope="module")
def client(server: LaunchedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
async def async_client(server: LaunchedServer) -> openai.AsyncOpenAI:
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    yield client
    await client.close()


def test_chat_streaming_equals_non_streaming_and_ends_with_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_completion_tokens=20
    )
    assert "Paris" in whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop"  # the model's end-of-turn token
    assert whole.usage.completion_tokens < 20 and whole.usage.prompt_tokens > 10
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=0,
            max_completion_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )


def test_completions_with_logprobs_streaming_and_not(client: openai.OpenAI) -> None:
    request = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 6, "logprobs": 2}
    whole = client.completions.create(**request)
    choice = whole.choices[0]
    assert "Paris" in choice.text and choice.finish_reason == "length"
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == whole.usage.completion_tokens == 6
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [
        len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))
    ]
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert 2 <= len(top) <= 3
        # Greedy picks the likeliest token of the model's distribution.
        assert top[token] == logprob == max(top.values()) and logprob <= 0
    streamed = list(client.completions.create(**request, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    streamed_tokens = [
        token for chunk in streamed if chunk.choices[0].logprobs
        for token in chunk.choices[0].logprobs.tokens
    ]  # fmt: skip
    assert streamed_tokens == logprobs.tokens


def test_chat_top_logprobs(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3
    )
    content = completion.choices[0].logprobs.content
    assert len(content) == 6
    for token in content:
        assert len(token.top_logprobs) == 3
        best = token.top_logprobs[0]
        assert (best.token, best.logprob) == (token.token, token.logprob)
        assert [t.logprob for t in token.top_logprobs] == sorted(
            (t.logprob for t in token.top_logprobs), reverse=True
        )
    utf8 = b"".join(bytes(token.bytes) for token in content)
    assert utf8.decode() == completion.choices[0].message.content


def test_n_samples_are_seeded_one_by_one(client: openai.OpenAI) -> None:
    both = client.chat.completions.create(
        model=MODEL, messages=QUESTION, n=2, seed=5, max_tokens=6, extra_body=NO_EOS, **SAMPLED
    )
    assert [c.index for c in both.choices] == [0, 1]
    assert both.usage.completion_tokens == 12
    first = client.chat.completions.create(
        model=MODEL, messages=QUESTION, seed=5, max_tokens=6, extra_body=NO_EOS, **SAMPLED
    )
    assert first.usage.prompt_tokens == both.usage.prompt_tokens
    assert first.choices[0].message.content == both.choices[0].message.content
    second = client.chat.completions.create(
        model=MODEL, messages=QUESTION, seed=6, max_tokens=6, extra_body=NO_EOS, **SAMPLED
    )
    assert second.choices[0].message.content == both.choices[1].message.content


async def test_n_streaming_with_usage(async_client: openai.AsyncOpenAI) -> None:
    stream = await async_client.completions.create(
        model=MODEL, prompt=PROMPT, n=2, seed=11, max_tokens=6, stream=True,
        stream_options={"include_usage": True}, **SAMPLED,
    )  # fmt: skip
    texts = {0: "", 1: ""}
    finish_reasons = {}
    chunks = [chunk async for chunk in stream]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            finish_reasons[choice.index] = choice.finish_reason
    assert finish_reasons == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 12
    whole = await async_client.completions.create(
        model=MODEL, prompt=PROMPT, n=2, seed=11, max_tokens=6, **SAMPLED
    )
    assert [c.text for c in whole.choices] == [texts[0], texts[1]]


def test_stop_strings(client: openai.OpenAI) -> None:
    request = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 10}
    free = client.completions.create(**request).choices[0].text
    words = free.split()
    assert len(words) >= 3, free
    stop = " " + words[2]
    cut = free[: free.index(stop)]
    stopped = client.completions.create(**request, stop=[stop, "never there"])
    assert stopped.choices[0].text == cut
    assert stopped.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(**request, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_same_seed_same_text(client: openai.OpenAI) -> None:
    texts = {
        client.completions.create(model=MODEL, prompt=PROMPT, seed=77, max_tokens=6, **SAMPLED)
        .choices[0]
        .text
        for _ in range(2)
    }
    assert len(texts) == 1


async def test_seeded_request_alone_equals_amid_15_others(
    async_client: openai.AsyncOpenAI,
) -> None:
    def seeded() -> dict:
        return {"model": MODEL, "prompt": "Once upon a time", "seed": 1234, "max_tokens": 8,
                **SAMPLED}  # fmt: skip

    alone = await async_client.completions.create(**seeded())
    others = [
        async_client.completions.create(
            model=MODEL,
            prompt=f"Story number {i}:",
            max_tokens=4 + i % 4,
            temperature=0.5 + i / 20,
            seed=i if i % 2 else None,
            extra_body={"top_k": 10 * i, "repetition_penalty": 1.1},
        )
        for i in range(15)
    ]
    results = await asyncio.gather(*others[:8], async_client.completions.create(**seeded()),
                                   *others[8:])  # fmt: skip
    assert results[8].choices[0].text == alone.choices[0].text


@pytest.mark.parametrize(
    ("param", "call"),
    [
        ("n", lambda c: c.chat.completions.create(model=MODEL, messages=QUESTION, n=0)),
        ("temperature", lambda c: c.completions.create(model=MODEL, prompt="a", temperature=-1)),
        ("top_p", lambda c: c.chat.completions.create(model=MODEL, messages=QUESTION, top_p=2)),
        ("logprobs", lambda c: c.completions.create(model=MODEL, prompt="a", logprobs=6)),
        (
            "top_logprobs",
            lambda c: c.chat.completions.create(
                model=MODEL, messages=QUESTION, logprobs=True, top_logprobs=21
            ),
        ),
        ("max_tokens", lambda c: c.completions.create(model=MODEL, prompt="a", max_tokens=0)),
        ("prompt", lambda c: c.completions.create(model=MODEL, prompt=[49152])),
        ("messages[0].role", lambda c: c.chat.completions.create(
            model=MODEL, messages=[{"role": "robot", "content": "hi"}])),
        ("max_tokens", lambda c: c.completions.create(
            model=MODEL, prompt=[5] * 8000, max_tokens=500)),
    ],
)  # fmt: skip
def test_bad_parameters_raise_bad_request(client: openai.OpenAI, param: str, call) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        call(client)
    assert raised.value.status_code == 400
    assert raised.value.param == param
    assert raised.value.body["type"] == "invalid_request_error"


def test_prompt_over_the_context_names_both_numbers(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt=[5] * 9000)
    assert raised.value.code == "context_length_exceeded"
    assert "8192" in raised.value.message and "9000" in raised.value.message


async def test_unknown_model_raises_not_found(async_client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        await async_client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert raised.value.code == "model_not_found"
