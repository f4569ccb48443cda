"""End to end: launch.py on the default model (SmolLM2, fp32), real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from tests.launched_server import LaunchedServer

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(float32_default_server: LaunchedServer) -> LaunchedServer:
    return float32_default_server


def stream_raw(server: LaunchedServer, path: str, body: dict) -> list[str]:
    request = urllib.request.Request(
        server.base_url + path, data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        return [line.decode() for line in response if line.strip()]


def test_streaming_chat_answers_paris_and_ends_with_done(server):
    lines = stream_raw(server, "/v1/chat/completions", {
        "model": MODEL, "messages": QUESTION, "stream": True, "temperature": 0,
        "max_tokens": 40})
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1].strip() == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert "Paris" in text
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_openai_sdk_chat_non_streaming(client):
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                              max_tokens=40)
    assert "Paris" in response.choices[0].message.content
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens > 0 and response.usage.prompt_tokens > 10


def test_openai_sdk_chat_streaming(client):
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                            max_tokens=40, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert "Paris" in text


def test_openai_sdk_completions_streaming_and_not(client):
    prompt = "The capital of France is"
    full = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
    streamed = client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                         max_tokens=8, stream=True)
    streamed_text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    assert full.choices[0].text == streamed_text
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 8
    assert "Paris" in full.choices[0].text


def test_openai_sdk_lists_the_model_and_rejects_an_unknown_one(client):
    assert [model.id for model in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=QUESTION)


def test_concurrent_requests_share_the_engine(client):
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"Count from {n} to {n + 5}:" for n in range(8)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: client.completions.create(
            model=MODEL, prompt=p, temperature=0, max_tokens=12), prompts))
    assert all(r.usage.completion_tokens == 12 for r in results)
    alone = client.completions.create(model=MODEL, prompt=prompts[3], temperature=0,
                                      max_tokens=12)
    assert alone.choices[0].text == results[3].choices[0].text


def post_json(server: LaunchedServer, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        server.base_url + path, data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_tokenize_counts_what_generation_bills(server, client):
    counted = post_json(server, "/tokenize", {"model": MODEL, "messages": QUESTION})
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert counted["count"] == response.usage.prompt_tokens == len(counted["tokens"])
    assert counted["max_model_len"] == 8192
    text = post_json(server, "/detokenize", {"model": MODEL, "tokens": counted["tokens"]})
    assert "What is the capital of France?" in text["prompt"]
    assert text["prompt"].startswith("<|im_start|>")
