"""The real frontend app over HTTP, in front of the scripted fake engine."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

from frontend.state import STATE
from tests.fake_engine import MAX_MODEL_LEN, MODEL_NAME, FrontendHarness

REPLY = "Hello world! The capital of France is Paris."


def parse_sse(raw: str) -> list[Any]:
    """The events of an SSE body; asserts the OpenAI framing."""
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")
    assert events[-1] == ""
    payloads = []
    for event in events[:-1]:
        assert event.startswith("data: "), event
        data = event[len("data: ") :]
        payloads.append(data if data == "[DONE]" else json.loads(data))
    assert payloads.count("[DONE]") == 1
    return payloads[:-1]


async def post(harness: FrontendHarness, path: str, body: dict[str, Any]):
    return await harness.client.post(path, json=body)


async def test_completion_non_streaming(harness: FrontendHarness) -> None:
    script = harness.reply_with(REPLY)
    response = await post(harness, "/v1/completions", {"model": MODEL_NAME, "prompt": "Hi"})
    assert response.status == 200
    body = await response.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL_NAME
    assert body["choices"] == [
        {"index": 0, "text": REPLY, "logprobs": None, "finish_reason": "stop"}
    ]
    prompt_tokens = len(harness.tokenizer.encode("Hi"))
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == len(script)  # EOS counts
    assert body["usage"]["total_tokens"] == prompt_tokens + len(script)
    add = harness.engine.adds[-1]
    assert add.request_id == body["id"]
    assert add.prompt_token_ids == harness.tokenizer.encode("Hi")
    assert add.sampling.max_tokens == MAX_MODEL_LEN - prompt_tokens


async def test_completion_streaming(harness: FrontendHarness) -> None:
    harness.reply_with(REPLY)
    response = await post(
        harness, "/v1/completions", {"prompt": [5, 6, 7], "stream": True, "max_tokens": 50}
    )
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    chunks = parse_sse(await response.text())
    assert all(chunk["object"] == "text_completion" for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "usage" not in chunks[0]
    assert harness.engine.adds[-1].prompt_token_ids == [5, 6, 7]


async def test_completion_length_limit(harness: FrontendHarness) -> None:
    harness.reply_with(REPLY)
    response = await post(harness, "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    body = await response.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["text"] == harness.tokenizer.decode(harness.encode(REPLY)[:3])
    assert body["usage"]["completion_tokens"] == 3


async def test_chat_non_streaming(harness: FrontendHarness) -> None:
    script = harness.reply_with(REPLY)
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Capital"},
                {"type": "text", "text": "of France?"},
            ],
        },
    ]
    response = await post(
        harness, "/v1/chat/completions", {"model": MODEL_NAME, "messages": messages}
    )
    assert response.status == 200
    body = await response.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    assert body["choices"][0]["finish_reason"] == "stop"
    rendered = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital\nof France?"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    expected_prompt = harness.encode(rendered)
    assert harness.engine.adds[-1].prompt_token_ids == expected_prompt
    assert body["usage"] == {
        "prompt_tokens": len(expected_prompt),
        "completion_tokens": len(script),
        "total_tokens": len(expected_prompt) + len(script),
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_chat_streaming_with_usage(harness: FrontendHarness) -> None:
    script = harness.reply_with(REPLY)
    response = await post(
        harness,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_completion_tokens": 100,
        },
    )
    chunks = parse_sse(await response.text())
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and first["content"], "the role comes with a token"
    content_chunks = chunks[:-1]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content_chunks)
    assert text == REPLY
    assert content_chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == len(script)
    assert harness.engine.adds[-1].sampling.max_tokens == 100


async def test_stop_string_excluded_and_engine_aborted(harness: FrontendHarness) -> None:
    harness.reply_with("The quick brown fox. Stop here. END of story.")
    response = await post(
        harness,
        "/v1/completions",
        {"prompt": "Hi", "stop": ["END", " here"], "stream": True, "ignore_eos": True},
    )
    chunks = parse_sse(await response.text())
    assert "".join(c["choices"][0]["text"] for c in chunks) == "The quick brown fox. Stop"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    request_id = chunks[0]["id"]
    await harness.engine.wait_for(lambda: request_id in harness.engine.aborted)


async def test_a_step_of_several_tokens_streams_as_one_event_cut_at_a_stop_string(
        harness: FrontendHarness) -> None:
    """Accepted drafts bring several tokens a step: each step's text is one event (as vLLM
    streams), its logprobs one entry per token; a stop string inside a step ends the text
    there and the tokens after it are not counted."""
    harness.engine.tokens_per_step = 4
    script = harness.reply_with("The quick brown fox jumps over the lazy dog. END of story.")
    response = await post(harness, "/v1/completions", {
        "prompt": "Hi", "stream": True, "logprobs": 0,
        "stream_options": {"include_usage": True}})
    chunks = parse_sse(await response.text())
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == harness.tokenizer.decode(script[:-1])  # up to the EOS
    steps = -(-len(script) // 4)
    assert len(texts) <= steps < len(script)
    tokens = [t for c in chunks if c["choices"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == len(script) - 1
    assert chunks[-1]["usage"]["completion_tokens"] == len(script)

    response = await post(harness, "/v1/completions", {
        "prompt": "Hi", "stop": [" lazy"], "stream": True,
        "stream_options": {"include_usage": True}})
    chunks = parse_sse(await response.text())
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == "The quick brown fox jumps over the"
    stopped = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    through_stop = len(harness.tokenizer.encode("The quick brown fox jumps over the lazy",
                                                add_special_tokens=False))
    assert chunks[-1]["usage"]["completion_tokens"] == through_stop


async def test_stop_string_non_streaming(harness: FrontendHarness) -> None:
    harness.reply_with("Hello world! The capital")
    response = await post(harness, "/v1/completions", {"prompt": "Hi", "stop": "world"})
    body = await response.json()
    assert body["choices"][0]["text"] == "Hello "
    assert body["choices"][0]["finish_reason"] == "stop"
    await harness.engine.wait_for(lambda: body["id"] in harness.engine.aborted)


async def test_stop_token_ids_finish_with_stop(harness: FrontendHarness) -> None:
    script = harness.reply_with("Hello world! The capital", eos=False)
    stop_token = script[2]
    response = await post(
        harness, "/v1/completions", {"prompt": "Hi", "stop_token_ids": [stop_token]}
    )
    body = await response.json()
    assert harness.engine.adds[-1].sampling.stop_token_ids == [stop_token]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == harness.tokenizer.decode(script[:2])
    assert body["usage"]["completion_tokens"] == 3


async def test_sampling_params_reach_the_engine(harness: FrontendHarness) -> None:
    harness.reply_with("Hi")
    response = await post(
        harness,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "seed": 7,
            "max_tokens": 20,
            "min_tokens": 2,
            "ignore_eos": False,
            "repetition_penalty": 1.1,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "logit_bias": {"5": 10, "6": -100},
            "stop_token_ids": [9],
            "some_future_field": {"ignored": True},
        },
    )
    assert response.status == 200
    sampling = harness.engine.adds[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (
        0.5,
        0.9,
        40,
        0.05,
    )
    assert (sampling.seed, sampling.max_tokens, sampling.min_tokens) == (7, 20, 2)
    assert (sampling.repetition_penalty, sampling.presence_penalty, sampling.frequency_penalty) == (
        1.1,
        0.5,
        -0.5,
    )
    assert sampling.logit_bias == {5: 10.0, 6: -100.0}
    assert sampling.stop_token_ids == [9]


async def test_unknown_model_is_404(harness: FrontendHarness) -> None:
    for path, body in [
        ("/v1/completions", {"model": "gpt-4", "prompt": "Hi"}),
        (
            "/v1/chat/completions",
            {"model": "gpt-4", "messages": [{"role": "user", "content": "Hi"}]},
        ),
    ]:
        response = await post(harness, path, body)
        assert response.status == 404
        error = (await response.json())["error"]
        assert error["code"] == "model_not_found"
        assert error["param"] == "model"
        assert "gpt-4" in error["message"]
    assert harness.engine.adds == []


async def test_models_and_health(harness: FrontendHarness) -> None:
    response = await harness.client.get("/v1/models")
    body = await response.json()
    assert body["object"] == "list"
    assert [model["id"] for model in body["data"]] == [MODEL_NAME]
    assert body["data"][0]["object"] == "model"
    assert body["data"][0]["max_model_len"] == MAX_MODEL_LEN
    response = await harness.client.get("/health")
    assert response.status == 200


async def test_health_without_engine_info_is_503(tokenizer: Any) -> None:
    async with FrontendHarness(tokenizer, engine_info_known=False) as harness:
        response = await harness.client.get("/health")
        assert response.status == 503
        response = await post(harness, "/v1/completions", {"prompt": "Hi"})
        assert response.status == 503
        assert (await response.json())["error"]["code"] == "engine_unavailable"


async def test_health_turns_503_when_the_engine_dies(harness: FrontendHarness) -> None:
    harness.reply_with(REPLY, eos=False)
    harness.engine.step_interval_s = 0.02
    response = await post(
        harness, "/v1/completions", {"prompt": "Hi", "stream": True, "max_tokens": 200}
    )
    assert response.status == 200
    await response.content.readuntil(b"\n\n")
    await harness.engine.stop()
    rest = (await response.content.read()).decode()
    assert '"error"' in rest and rest.endswith("data: [DONE]\n\n")
    async with asyncio.timeout(5):
        while (await harness.client.get("/health")).status != 503:
            await asyncio.sleep(0.02)
    response = await post(harness, "/v1/completions", {"prompt": "Hi"})
    assert response.status == 503


async def test_client_disconnect_mid_stream_aborts(harness: FrontendHarness) -> None:
    harness.reply_with(REPLY, eos=False)
    harness.engine.step_interval_s = 0.01
    response = await post(
        harness, "/v1/completions", {"prompt": "Hi", "stream": True, "max_tokens": 200}
    )
    await response.content.readuntil(b"\n\n")
    request_id = harness.engine.adds[-1].request_id
    response.close()
    await harness.engine.wait_for(lambda: request_id in harness.engine.aborted)
    assert harness.engine.num_running == 0


async def test_client_disconnect_non_streaming_aborts(harness: FrontendHarness) -> None:
    harness.reply_with(REPLY, eos=False)
    harness.engine.step_interval_s = 0.01
    task = asyncio.create_task(
        post(harness, "/v1/completions", {"prompt": "Hi", "max_tokens": 200})
    )
    await harness.engine.wait_for(lambda: harness.engine.num_running == 1)
    request_id = harness.engine.adds[-1].request_id
    task.cancel()
    await harness.engine.wait_for(lambda: request_id in harness.engine.aborted)


async def test_malformed_frame_is_dropped(harness: FrontendHarness) -> None:
    await harness.engine.send_raw(b"\xc1 definitely not msgpack")
    await harness.engine.send_raw(b"\x92\x63\x0b")  # [99, 11]: wrong protocol version
    harness.reply_with("Hi")
    response = await post(harness, "/v1/completions", {"prompt": "Hi"})
    assert response.status == 200
    assert (await response.json())["choices"][0]["text"] == "Hi"
    assert harness.app[STATE].engine.clients[0].num_bad_frames == 2


async def test_engine_refusal_is_400(harness: FrontendHarness) -> None:
    harness.engine.refuse = lambda request: "prompt does not fit in the KV cache"
    response = await post(harness, "/v1/completions", {"prompt": "Hi"})
    assert response.status == 400
    error = (await response.json())["error"]
    assert "KV cache" in error["message"]


async def test_invalid_json_is_400(harness: FrontendHarness) -> None:
    response = await harness.client.post(
        "/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert "JSON" in error["message"]


async def test_unknown_route_is_an_openai_error(harness: FrontendHarness) -> None:
    response = await harness.client.get("/v1/nothing")
    assert response.status == 404
    assert "error" in await response.json()


async def test_streamed_multibyte_text_never_breaks_a_character(harness: FrontendHarness) -> None:
    text = "Emoji 😀🇫🇷 and CJK 你好世界, done."
    harness.reply_with(text)
    response = await post(
        harness, "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "stream": True},
    )  # fmt: skip
    chunks = parse_sse(await response.text())
    pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) == text
    assert len([piece for piece in pieces if piece]) > 3  # it really streamed


class SlowTokenizer:
    """Delegates to a tokenizer; encoding blocks its thread like a huge prompt would."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self._inner = inner
        self._delay_s = delay_s
        self.started = threading.Event()  # set once encoding has begun

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        self.started.set()
        time.sleep(self._delay_s)
        return self._inner.encode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def test_tokenization_does_not_block_the_event_loop(harness: FrontendHarness) -> None:
    harness.reply_with("Hi")
    service = harness.app[STATE].tokenizer
    service.tokenizer = slow_tokenizer = SlowTokenizer(service.tokenizer, delay_s=1.0)
    slow = asyncio.create_task(post(harness, "/v1/completions", {"prompt": "x" * 100_000}))
    assert await asyncio.to_thread(slow_tokenizer.started.wait, 5.0)
    started = time.monotonic()
    assert (await harness.client.get("/health")).status == 200
    assert time.monotonic() - started < 0.5
    response = await slow
    assert response.status == 400  # 100k characters do not fit in the fake model's context
    error = (await response.json())["error"]
    assert error["code"] == "context_length_exceeded"
