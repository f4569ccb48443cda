"""Logprobs in the chat and legacy completions formats, and how tokens are shown."""

from __future__ import annotations

from typing import Any

import pytest

from frontend.detokenizer import REPLACEMENT_CHAR
from frontend.token_texts import TokenTexts, byte_level_alphabet
from tests.fake_engine import FrontendHarness
from tests.test_frontend import parse_sse

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]
ASCII_REPLY = "Hello world! The capital"
MIXED_REPLY = "Hi 😀 你好 there"


def shown(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


async def test_completion_logprobs_legacy_format(harness: FrontendHarness) -> None:
    script = harness.reply_with(ASCII_REPLY)
    text_ids = script[:-1]  # the EOS that ends the reply is not part of the text
    response = await harness.client.post(COMPLETIONS, json={"prompt": "Hi", "logprobs": 2})
    choice = (await response.json())["choices"][0]
    assert harness.engine.adds[-1].sampling.logprobs == 2
    assert choice["text"] == ASCII_REPLY
    logprobs = choice["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    tokens = [shown(harness.tokenizer, t) for t in text_ids]
    assert logprobs["tokens"] == tokens
    assert "".join(tokens) == ASCII_REPLY
    assert logprobs["token_logprobs"] == [-0.5] * len(text_ids)
    # The fake engine's top-2 are the chosen token (-0.5) and the next id (-1.5).
    assert logprobs["top_logprobs"] == [
        {shown(harness.tokenizer, t): -0.5, shown(harness.tokenizer, t + 1): -1.5}
        for t in text_ids
    ]
    offsets = logprobs["text_offset"]
    assert offsets == [len(harness.tokenizer.decode(text_ids[:i])) for i in range(len(text_ids))]


async def test_completion_logprobs_zero_still_shows_the_sampled_token(
    harness: FrontendHarness,
) -> None:
    script = harness.reply_with(ASCII_REPLY)
    response = await harness.client.post(COMPLETIONS, json={"prompt": "Hi", "logprobs": 0})
    logprobs = (await response.json())["choices"][0]["logprobs"]
    assert logprobs["top_logprobs"] == [{shown(harness.tokenizer, t): -0.5} for t in script[:-1]]


async def test_sampled_token_outside_the_top_is_added(harness: FrontendHarness) -> None:
    script = harness.reply_with("Hello", eos=False)
    harness.engine.logprobs = lambda token, n: [-3.0, [[token + 1, -0.1]]]
    response = await harness.client.post(
        COMPLETIONS, json={"prompt": "Hi", "logprobs": 1, "max_tokens": 1}
    )
    top = (await response.json())["choices"][0]["logprobs"]["top_logprobs"][0]
    assert top == {shown(harness.tokenizer, script[0] + 1): -0.1,
                   shown(harness.tokenizer, script[0]): -3.0}  # fmt: skip


async def test_minus_infinity_is_clamped(harness: FrontendHarness) -> None:
    harness.reply_with("Hello", eos=False)
    harness.engine.logprobs = lambda token, n: [float("-inf"), [[token, float("-inf")]]]
    response = await harness.client.post(
        CHAT, json={"messages": USER, "logprobs": True, "top_logprobs": 1, "max_tokens": 1}
    )
    assert response.status == 200
    entry = (await response.json())["choices"][0]["logprobs"]["content"][0]
    assert entry["logprob"] == -9999.0 and entry["top_logprobs"][0]["logprob"] == -9999.0


async def test_chat_logprobs_format_with_multibyte_text(harness: FrontendHarness) -> None:
    script = harness.reply_with(MIXED_REPLY)
    text_ids = script[:-1]
    response = await harness.client.post(
        CHAT, json={"messages": USER, "logprobs": True, "top_logprobs": 3}
    )
    choice = (await response.json())["choices"][0]
    assert harness.engine.adds[-1].sampling.logprobs == 3
    assert choice["message"]["content"] == MIXED_REPLY
    content = choice["logprobs"]["content"]
    assert len(content) == len(text_ids)
    for entry, token_id in zip(content, text_ids, strict=True):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["token"] == shown(harness.tokenizer, token_id)
        assert entry["logprob"] == -0.5
        assert [top["logprob"] for top in entry["top_logprobs"]] == [-0.5, -1.5, -2.5]
        assert entry["top_logprobs"][0]["token"] == entry["token"]
    assert any(REPLACEMENT_CHAR in entry["token"] for entry in content), "needs split chars"
    utf8 = b"".join(bytes(entry["bytes"]) for entry in content)
    assert utf8.decode() == MIXED_REPLY


async def test_chat_logprobs_without_top(harness: FrontendHarness) -> None:
    harness.reply_with(ASCII_REPLY)
    response = await harness.client.post(CHAT, json={"messages": USER, "logprobs": True})
    content = (await response.json())["choices"][0]["logprobs"]["content"]
    assert harness.engine.adds[-1].sampling.logprobs == 0
    assert content and all(entry["top_logprobs"] == [] for entry in content)


async def test_no_logprobs_unless_asked(harness: FrontendHarness) -> None:
    harness.reply_with(ASCII_REPLY)
    response = await harness.client.post(CHAT, json={"messages": USER, "logprobs": False})
    assert (await response.json())["choices"][0]["logprobs"] is None
    assert harness.engine.adds[-1].sampling.logprobs is None


@pytest.mark.parametrize(
    ("path", "fields", "key"),
    [
        (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 2}, "content"),
        (COMPLETIONS, {"prompt": "Hi", "logprobs": 2}, "tokens"),
    ],
)
async def test_streamed_logprobs_equal_non_streamed(
    harness: FrontendHarness, path: str, fields: dict[str, Any], key: str
) -> None:
    harness.reply_with(MIXED_REPLY)
    whole = (await (await harness.client.post(path, json=fields)).json())["choices"][0]
    response = await harness.client.post(path, json={**fields, "stream": True})
    chunks = [c for c in parse_sse(await response.text()) if c["choices"]]
    streamed: dict[str, list[Any]] = {}
    for chunk in chunks:
        logprobs = chunk["choices"][0]["logprobs"]
        for name, values in (logprobs or {}).items():
            if isinstance(values, list):
                streamed.setdefault(name, []).extend(values)
    assert streamed[key]
    expected = {name: v for name, v in whole["logprobs"].items() if isinstance(v, list)}
    assert streamed == expected


async def test_logprobs_with_n_choices(harness: FrontendHarness) -> None:
    script = harness.reply_with(ASCII_REPLY)
    response = await harness.client.post(
        COMPLETIONS, json={"prompt": ["Hi", "Hello"], "n": 2, "logprobs": 1}
    )
    choices = (await response.json())["choices"]
    assert len(choices) == 4
    for choice in choices:
        assert len(choice["logprobs"]["tokens"]) == len(script) - 1


def test_token_texts_give_the_real_bytes_of_partial_characters(tokenizer: Any) -> None:
    texts = TokenTexts(tokenizer)
    token_ids = tokenizer.encode(MIXED_REPLY, add_special_tokens=False)
    shown_tokens = [texts(token_id) for token_id in token_ids]
    assert any(REPLACEMENT_CHAR in token.text for token in shown_tokens)
    assert b"".join(token.utf8 for token in shown_tokens).decode() == MIXED_REPLY
    assert [token.text for token in shown_tokens] == [shown(tokenizer, t) for t in token_ids]
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert texts(special).text == "<|im_end|>"


def test_byte_level_alphabet_covers_every_byte_once() -> None:
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["Ġ"] == ord(" ") and alphabet["A"] == ord("A")
