"""POST /tokenize and /detokenize: the server's tokenizer and chat template, as generation
uses them; bad input is a 400 naming the parameter."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fake_engine import MAX_MODEL_LEN, MODEL_NAME, FrontendHarness

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Capital of France?"}]


async def post(harness: FrontendHarness, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    response = await harness.client.post(path, json=body)
    return response.status, await response.json()


async def test_a_prompt_tokenizes_as_a_completion_sends_it(harness: FrontendHarness) -> None:
    harness.reply_with("Hi")
    status, answer = await post(harness, "/tokenize", {"prompt": "Hello world!"})
    assert status == 200
    completion_status, _ = await post(harness, "/v1/completions", {"prompt": "Hello world!"})
    assert completion_status == 200
    sent = harness.engine.adds[-1].prompt_token_ids
    assert answer == {"count": len(sent), "max_model_len": MAX_MODEL_LEN, "tokens": sent}
    status, bare = await post(harness, "/tokenize",
                              {"model": MODEL_NAME, "prompt": "Hello world!",
                               "add_special_tokens": False})
    assert status == 200 and bare["tokens"] == harness.encode("Hello world!")


async def test_messages_tokenize_as_a_chat_completion_sends_them(
    harness: FrontendHarness,
) -> None:
    harness.reply_with("Paris")
    status, answer = await post(harness, "/tokenize", {"messages": MESSAGES})
    assert status == 200
    chat_status, chat = await post(harness, "/v1/chat/completions", {"messages": MESSAGES})
    assert chat_status == 200
    assert answer["tokens"] == harness.engine.adds[-1].prompt_token_ids
    assert answer["count"] == chat["usage"]["prompt_tokens"]
    status, no_prompt = await post(harness, "/tokenize",
                                   {"messages": MESSAGES, "add_generation_prompt": False})
    assert status == 200
    assert no_prompt["tokens"] == harness.encode(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital of France?"
        "<|im_end|>\n")
    assert len(no_prompt["tokens"]) < answer["count"]


async def test_detokenize_inverts_tokenize(harness: FrontendHarness) -> None:
    text = "Grüße, 世界! 🙂"
    _, answer = await post(harness, "/tokenize", {"prompt": text, "add_special_tokens": False})
    status, back = await post(harness, "/detokenize", {"tokens": answer["tokens"]})
    assert status == 200 and back == {"prompt": text}
    assert await post(harness, "/detokenize", {"tokens": []}) == (200, {"prompt": ""})


BAD = [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "Hi", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"prompt": [1, 2]}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"prompt": "Hi", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD, ids=[f"{p}-{i}" for i, (p, _, _)
                                                               in enumerate(BAD)])
async def test_bad_input_is_400(harness: FrontendHarness, path: str, body: dict[str, Any],
                                param: str) -> None:
    status, answer = await post(harness, path, body)
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["param"] == param


async def test_an_unknown_model_is_404(harness: FrontendHarness) -> None:
    for path, body in [("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [5]})]:
        status, answer = await post(harness, path, {**body, "model": "gpt-4"})
        assert status == 404 and answer["error"]["code"] == "model_not_found"
