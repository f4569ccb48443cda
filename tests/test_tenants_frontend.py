"""Tenants and deadlines through the real frontend app, in front of the scripted fake engine:
401s, 429s with Retry-After, what reaches the engine, deadline errors and timeouts."""

from __future__ import annotations

import asyncio
import tomllib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from common.protocol import FinishReason, RequestError, RequestOutput, StepOutputs, StepStats
from frontend.state import STATE
from frontend.tenants import parse_tenants
from tests.fake_engine import MODEL_NAME, FrontendHarness
from tests.test_tenants import GOOD, KEY_A, KEY_B

CHAT = "/v1/chat/completions"


def chat(max_tokens: int = 3, stream: bool = False) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": max_tokens, "stream": stream}


def auth(key: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **headers}


@pytest.fixture
async def tenants(tokenizer: Any) -> AsyncIterator[FrontendHarness]:
    table = parse_tenants(tomllib.loads(GOOD))
    async with FrontendHarness(tokenizer, tenants=table) as running:
        yield running


async def test_unknown_and_missing_keys_are_401_with_an_openai_body(tenants):
    for headers, message in [({}, "Missing API key"), (auth("sk-nobody"), "Incorrect API key"),
                             ({"x-api-key": "sk-nobody"}, "Incorrect API key")]:
        response = await tenants.client.post(CHAT, json=chat(), headers=headers)
        assert response.status == 401
        error = (await response.json())["error"]
        assert error["code"] == "invalid_api_key" and message in error["message"]
    assert tenants.engine.adds == []
    assert (await tenants.client.get("/health")).status == 200  # open, as before


async def test_each_key_reaches_the_engine_as_its_tenant_with_its_weight(tenants):
    for key in (KEY_A, KEY_B):
        response = await tenants.client.post(CHAT, json=chat(), headers=auth(key))
        assert response.status == 200, await response.text()
    response = await tenants.client.post(CHAT, json=chat(), headers={"x-api-key": "sk-old-b"})
    assert response.status == 200
    assert [(add.tenant, add.tenant_weight) for add in tenants.engine.adds] == [
        ("team-a", 2.0), ("team-b", 1.0), ("team-b", 1.0)]
    metrics = await (await tenants.client.get("/metrics")).text()
    assert 'loom:tenant_requests_total{tenant="team-b"} 2.0' in metrics
    assert 'loom:tenant_prompt_tokens_total{tenant="team-a"}' in metrics
    assert 'loom:tenant_generation_tokens_total{tenant="team-a"} 3.0' in metrics


async def test_the_concurrency_cap_gives_a_429_with_retry_after_until_one_ends(tenants):
    tenants.reply_with("word " * 50, eos=False)
    tenants.engine.step_interval_s = 0.05  # 200 tokens: 10 s, far longer than the test
    first = asyncio.create_task(tenants.client.post(CHAT, json=chat(200, stream=True),
                                                    headers=auth(KEY_A)))
    second = asyncio.create_task(tenants.client.post(CHAT, json=chat(200, stream=True),
                                                     headers=auth(KEY_A)))
    await tenants.engine.wait_for(lambda: tenants.engine.num_running == 2)
    refused = await tenants.client.post(CHAT, json=chat(), headers=auth(KEY_A))
    assert refused.status == 429 and refused.headers["Retry-After"] == "1"
    error = (await refused.json())["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert error["param"] == "max_concurrent_requests" and "team-a" in error["message"]
    other = await tenants.client.post(CHAT, json=chat(), headers=auth(KEY_B))
    assert other.status == 200  # another tenant's cap is its own
    (await first).close()
    await tenants.engine.wait_for(lambda: tenants.engine.num_running == 1)
    tenants.reply_with("fine")
    again = await tenants.client.post(CHAT, json=chat(), headers=auth(KEY_A))
    assert again.status == 200
    (await second).close()
    metrics = await (await tenants.client.get("/metrics")).text()
    assert ('loom:tenant_requests_rejected_total{limit="max_concurrent_requests",'
            'tenant="team-a"} 1.0') in metrics


async def test_the_deadline_header_reaches_the_engine_as_the_time_left(harness):
    response = await harness.client.post(CHAT, json=chat(),
                                         headers={"X-Request-Timeout": "30"})
    assert response.status == 200
    timeout_s = harness.engine.adds[0].timeout_s
    assert timeout_s is not None and 25 < timeout_s <= 30
    bad = await harness.client.post(CHAT, json=chat(), headers={"X-Request-Timeout": "soon"})
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "X-Request-Timeout"
    assert len(harness.engine.adds) == 1 and harness.engine.adds[0].tenant == ""


async def test_a_request_dropped_unstarted_at_its_deadline_is_a_504(harness):
    harness.engine.refuse = lambda request: "its deadline passed; it was never started"
    harness.engine.refusal_code = RequestError.DEADLINE_EXCEEDED
    response = await harness.client.post(CHAT, json=chat(), headers={"X-Request-Timeout": "5"})
    assert response.status == 504
    error = (await response.json())["error"]
    assert error["code"] == "deadline_exceeded" and "never started" in error["message"]


async def test_a_request_cut_at_its_deadline_says_length_and_why(harness):
    harness.reply_with("word " * 50, eos=False)
    harness.engine.step_interval_s = 0.05  # 200 tokens: 10 s, far longer than the test
    reply = asyncio.create_task(harness.client.post(CHAT, json=chat(200), headers={
        "X-Request-Timeout": "5"}))
    await harness.engine.wait_for(lambda: harness.engine.step >= 3)
    request_id = harness.engine.adds[0].request_id
    await harness.engine.send(StepOutputs(harness.engine.step + 1, [
        RequestOutput(request_id, [], FinishReason.TIMEOUT)]))
    response = await reply
    assert response.status == 200
    choice = (await response.json())["choices"][0]
    assert choice["finish_reason"] == "length" and choice["native_finish_reason"] == "timeout"
    assert choice["message"]["content"].startswith("word")
    metrics = await (await harness.client.get("/metrics")).text()
    assert 'loom:request_success_total{finished_reason="timeout"} 1.0' in metrics


async def test_without_tenants_any_key_passes_and_no_tenant_series_appear(harness):
    response = await harness.client.post(CHAT, json=chat(), headers=auth("anything"))
    assert response.status == 200
    choice = (await response.json())["choices"][0]
    assert "native_finish_reason" not in choice
    assert "tenant_" not in await (await harness.client.get("/metrics")).text()


async def test_admission_control_refuses_what_the_queue_cannot_start_in_time(tokenizer):
    async with FrontendHarness(tokenizer, admission_control=True) as harness:
        queue = harness.app[STATE].queue_estimate
        for _ in range(4):  # measured: 10 prompt tokens a second while requests waited
            queue.observe_step(StepStats(num_waiting=1, num_prompt_tokens=1, step_time_s=0.1))
        refused = await harness.client.post(CHAT, json=chat(),
                                            headers={"X-Request-Timeout": "0.5"})
        assert refused.status == 503 and int(refused.headers["Retry-After"]) >= 1
        error = (await refused.json())["error"]
        assert error["code"] == "deadline_unattainable" and "deadline" in error["message"]
        assert harness.engine.adds == []
        # The same request with time enough, or with no deadline, is served.
        for headers in ({"X-Request-Timeout": "600"}, {}):
            response = await harness.client.post(CHAT, json=chat(), headers=headers)
            assert response.status == 200, await response.text()
        assert queue.pending == {}  # each left the estimate once its output came back
