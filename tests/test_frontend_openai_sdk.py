"""The official openai SDK against the frontend (fake engine behind it)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from tests.fake_engine import MODEL_NAME, FrontendHarness

REPLY = "Paris is the capital of France. 😀 你好"


@pytest.fixture
async def sdk(harness: FrontendHarness) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(
        api_key="unused",
        base_url=harness.url("/v1"),
        max_retries=0,
        _strict_response_validation=True,
    )
    yield client
    await client.close()


MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
]


async def test_chat_non_streaming(harness: FrontendHarness, sdk: openai.AsyncOpenAI) -> None:
    script = harness.reply_with(REPLY)
    completion = await sdk.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=64, temperature=0
    )
    assert completion.id.startswith("chatcmpl-")
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content == REPLY
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == len(script)
    assert completion.usage.total_tokens == (
        completion.usage.prompt_tokens + completion.usage.completion_tokens
    )
    assert harness.engine.adds[-1].sampling.temperature == 0


async def test_chat_streaming(harness: FrontendHarness, sdk: openai.AsyncOpenAI) -> None:
    harness.reply_with(REPLY)
    stream = await sdk.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
        stop=["capital"],
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Paris is the "
    finish_reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish_reasons[-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


async def test_completions_and_models(harness: FrontendHarness, sdk: openai.AsyncOpenAI) -> None:
    harness.reply_with(REPLY)
    completion = await sdk.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=3)
    assert completion.choices[0].finish_reason == "length"
    models = await sdk.models.list()
    assert [model.id for model in models.data] == [MODEL_NAME]


async def test_errors_surface_as_sdk_exceptions(sdk: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        await sdk.chat.completions.create(model="nope", messages=MESSAGES)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        await sdk.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, top_p=7)
    assert bad.value.param == "top_p"


async def test_n_and_logprobs_pass_strict_sdk_validation(
    harness: FrontendHarness, sdk: openai.AsyncOpenAI
) -> None:
    harness.reply_with(REPLY)
    chat = await sdk.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, n=2, logprobs=True, top_logprobs=2
    )
    assert [choice.index for choice in chat.choices] == [0, 1]
    content = chat.choices[1].logprobs.content
    assert b"".join(bytes(token.bytes) for token in content).decode() == REPLY
    stream = await sdk.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, n=2, logprobs=True, stream=True
    )
    streamed = {0: "", 1: ""}
    async for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == {0: REPLY, 1: REPLY}
    completion = await sdk.completions.create(
        model=MODEL_NAME, prompt=[[5, 6], [7]], n=2, logprobs=3, max_tokens=4
    )
    assert len(completion.choices) == 4
    assert all(len(choice.logprobs.tokens) == 4 for choice in completion.choices)
    echoed = await sdk.completions.create(model=MODEL_NAME, prompt="Hi", echo=True)
    assert echoed.choices[0].text == "Hi" + REPLY
