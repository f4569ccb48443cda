"""Bad requests get HTTP 400 with an OpenAI error body naming the parameter."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from frontend.state import STATE
from tests.fake_engine import MAX_MODEL_LEN, FrontendHarness

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]


def completion(**fields: Any) -> tuple[str, dict[str, Any]]:
    return COMPLETIONS, {"prompt": "Hi", **fields}


def chat(**fields: Any) -> tuple[str, dict[str, Any]]:
    return CHAT, {"messages": USER, **fields}


BAD_REQUESTS: list[tuple[str, tuple[str, dict[str, Any]]]] = [
    ("max_tokens", completion(max_tokens=0)),
    ("max_tokens", completion(max_tokens=-5)),
    ("max_tokens", completion(max_tokens="ten")),
    ("max_tokens", completion(max_tokens=1.5)),
    ("max_tokens", chat(max_tokens=True)),
    ("max_completion_tokens", chat(max_completion_tokens=0)),
    ("temperature", completion(temperature=-0.1)),
    ("temperature", chat(temperature="hot")),
    ("top_p", completion(top_p=0)),
    ("top_p", completion(top_p=1.5)),
    ("top_k", completion(top_k=-2)),
    ("top_k", completion(top_k=0.5)),
    ("min_p", completion(min_p=1.5)),
    ("seed", completion(seed="abc")),
    ("seed", completion(seed=2**64)),
    ("repetition_penalty", completion(repetition_penalty=0)),
    ("presence_penalty", completion(presence_penalty=2.5)),
    ("frequency_penalty", chat(frequency_penalty=-3)),
    ("min_tokens", completion(min_tokens=-1)),
    ("min_tokens", completion(min_tokens=10, max_tokens=5)),
    ("priority", completion(priority=1.5)),
    ("priority", chat(priority=2**63)),
    ("priority", chat(priority=-1)),  # the fake engine schedules FCFS: priorities are refused
    ("ignore_eos", completion(ignore_eos="yes")),
    ("stop", completion(stop=5)),
    ("stop", completion(stop=["ok", 3])),
    ("stop", completion(stop=[""])),
    ("stop_token_ids", completion(stop_token_ids=[1, -1])),
    ("stop_token_ids", completion(stop_token_ids=[10**9])),
    ("stop_token_ids", completion(stop_token_ids=5)),
    ("logit_bias", completion(logit_bias={"abc": 1})),
    ("logit_bias", completion(logit_bias={"5": 101})),
    ("logit_bias", completion(logit_bias={"999999": 1})),
    ("logit_bias", completion(logit_bias=[1, 2])),
    ("stream", completion(stream="true")),
    ("stream_options", completion(stream_options={"include_usage": True})),
    ("stream_options.include_usage", chat(stream=True, stream_options={"include_usage": 1})),
    ("n", chat(n=0)),
    ("n", completion(n=129)),
    ("n", chat(n="2")),
    ("n", completion(n=1.5)),
    ("best_of", completion(best_of=3)),
    ("best_of", completion(n=2, best_of=1)),
    ("echo", completion(echo="yes")),
    ("echo", completion(echo=True, logprobs=0)),
    ("logprobs", completion(logprobs=6)),
    ("logprobs", completion(logprobs=-1)),
    ("logprobs", completion(logprobs=True)),
    ("logprobs", completion(logprobs="2")),
    ("logprobs", chat(logprobs="yes")),
    ("logprobs", chat(logprobs=1)),
    ("top_logprobs", chat(top_logprobs=2)),
    ("top_logprobs", chat(logprobs=False, top_logprobs=2)),
    ("top_logprobs", chat(logprobs=True, top_logprobs=21)),
    ("top_logprobs", chat(logprobs=True, top_logprobs=-1)),
    ("top_logprobs", chat(logprobs=True, top_logprobs=1.5)),
    ("suffix", completion(suffix="tail")),
    ("model", completion(model=42)),
    ("prompt", (COMPLETIONS, {})),
    ("prompt", completion(prompt="")),
    ("prompt", completion(prompt=[])),
    ("prompt", completion(prompt=[1, "a"])),
    ("prompt", completion(prompt=["a", [1]])),
    ("prompt", completion(prompt=[[1, 2], 3])),
    ("prompt", completion(prompt=[[1, 2], []])),
    ("prompt", completion(prompt=[[1, 2], [-1]])),
    ("prompt", completion(prompt=[["a"]])),
    ("prompt", completion(prompt=[None])),
    ("prompt", completion(prompt=["x"] * 9, n=128)),
    ("prompt", completion(prompt=[-1])),
    ("prompt", completion(prompt=[10**9])),
    ("prompt", completion(prompt={"text": "Hi"})),
    ("messages", (CHAT, {})),
    ("messages", chat(messages=[])),
    ("messages", chat(messages="Hi")),
    ("messages[0]", chat(messages=["Hi"])),
    ("messages[0].role", chat(messages=[{"role": "robot", "content": "Hi"}])),
    ("messages[0].role", chat(messages=[{"content": "Hi"}])),
    ("messages[0].content", chat(messages=[{"role": "user", "content": 5}])),
    ("messages[0].content", chat(messages=[{"role": "user"}])),
    (
        "messages[1].content[0]",
        chat(
            messages=[
                *USER,
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                },
            ]
        ),
    ),
    (
        "messages[0].content[0].text",
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": None}]}]),
    ),
]


@pytest.mark.parametrize(
    ("param", "request_"),
    BAD_REQUESTS,
    ids=[f"{i}-{param}" for i, (param, _) in enumerate(BAD_REQUESTS)],
)
async def test_bad_parameter_is_400(
    harness: FrontendHarness, param: str, request_: tuple[str, dict[str, Any]]
) -> None:
    path, body = request_
    response = await harness.client.post(path, json=body)
    assert response.status == 400, await response.text()
    error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert isinstance(error["message"], str) and error["message"]
    assert harness.engine.adds == []


async def test_body_must_be_a_json_object(harness: FrontendHarness) -> None:
    for raw in [b"[1, 2]", b"", b'{"prompt": NaN}', b"\xff\xfe"]:
        response = await harness.client.post(COMPLETIONS, data=raw)
        assert response.status == 400
        assert (await response.json())["error"]["type"] == "invalid_request_error"


async def test_prompt_plus_max_tokens_over_context_is_400(harness: FrontendHarness) -> None:
    prompt = harness.encode("Hello world! ") * 20
    response = await harness.client.post(
        COMPLETIONS, json={"prompt": prompt, "max_tokens": MAX_MODEL_LEN}
    )
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["param"] == "max_tokens"
    assert error["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in error["message"]
    assert f"{len(prompt)} in the prompt" in error["message"]
    assert f"{MAX_MODEL_LEN} in max_tokens" in error["message"]


async def test_prompt_alone_over_context_is_400(harness: FrontendHarness) -> None:
    prompt = [5] * MAX_MODEL_LEN
    response = await harness.client.post(COMPLETIONS, json={"prompt": prompt})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in error["message"] and str(len(prompt)) in error["message"]


async def test_default_max_tokens_fills_the_context(harness: FrontendHarness) -> None:
    harness.reply_with("Hi")
    prompt = [5] * (MAX_MODEL_LEN - 1)
    response = await harness.client.post(COMPLETIONS, json={"prompt": prompt})
    assert response.status == 200
    assert harness.engine.adds[-1].sampling.max_tokens == 1


async def test_accepted_variants(harness: FrontendHarness) -> None:
    harness.reply_with("Hi")
    accepted = [
        completion(prompt=["Hi"]),
        completion(prompt=[[5, 6]]),
        completion(max_tokens=5.0, top_k=-1, stop=None, seed=-3, n=1, logprobs=None),
        chat(
            messages=[
                {"role": "developer", "content": "Be brief."},
                *USER,
                {"role": "assistant", "content": None},
                *USER,
            ]
        ),
        chat(max_tokens=3, max_completion_tokens=4, unknown={"nested": [1]}),
    ]
    for path, body in accepted:
        response = await harness.client.post(path, json=body)
        assert response.status == 200, await response.text()
    assert harness.engine.adds[1].prompt_token_ids == [5, 6]
    assert harness.engine.adds[2].sampling.max_tokens == 5
    assert harness.engine.adds[4].sampling.max_tokens == 4


async def test_priority_reaches_the_engine_when_it_schedules_by_priority(tokenizer: Any) -> None:
    async with FrontendHarness(tokenizer) as harness:
        harness.reply_with("Hi")
        settings = harness.app[STATE].settings
        assert settings.engine_info is not None
        settings.engine_info = replace(settings.engine_info, priority_scheduling=True)
        for path, body in [completion(priority=-7, n=2), chat(priority=2**63 - 1), chat()]:
            response = await harness.client.post(path, json=body)
            assert response.status == 200, await response.text()
        assert [add.priority for add in harness.engine.adds] == [-7, -7, 2**63 - 1, 0]


async def test_kv_cache_smaller_than_the_context_caps_requests(tokenizer: Any) -> None:
    async with FrontendHarness(tokenizer) as harness:
        harness.reply_with("Hi")
        settings = harness.app[STATE].settings
        assert settings.engine_info is not None
        settings.engine_info = replace(settings.engine_info, num_kv_blocks=4, block_size=16)
        response = await harness.client.post(COMPLETIONS, json={"prompt": [5] * 10})
        assert response.status == 200
        assert harness.engine.adds[-1].sampling.max_tokens == 64 - 10
        response = await harness.client.post(
            COMPLETIONS, json={"prompt": [5] * 10, "max_tokens": 60}
        )
        assert response.status == 400
        error = (await response.json())["error"]
        assert error["code"] == "context_length_exceeded"
        assert "64 tokens" in error["message"] and "10 in the prompt" in error["message"]
