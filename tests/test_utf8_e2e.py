"""Multi-byte UTF-8 (emoji, CJK) split across tokens of the default model's tokenizer:
never a broken character in a delta, and streamed text == non-streamed text == the
tokenizer's decode of the generated tokens."""

from __future__ import annotations

import random
from typing import Any

import openai
import pytest

from common.default_model import resolve_model
from frontend.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from frontend.token_texts import TokenTexts
from tests.launched_server import LaunchedServer

MODEL = "SmolLM2-135M-Instruct"
MIXED = "Emoji 😀🎉🇫🇷👩‍👩‍👧 CJK 你好世界\uff0c日本語の文章 한국어 — naïve café"
EMOJI_PROMPT = "Emoji story: 😀😀😀 🎉"
TRANSLATE = [{"role": "user", "content": "Translate to Chinese: I love my family."}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(resolve_model(None))


def detokenize(tokenizer: Any, token_ids: list[int], sizes: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas, position = [], 0
    for size in sizes:
        deltas.append(detokenizer.push(token_ids[position : position + size]))
        position += size
    return [*deltas, detokenizer.flush()]


def test_detokenizer_on_the_default_tokenizer(tokenizer: Any) -> None:
    token_ids = tokenizer.encode(MIXED, add_special_tokens=False)
    singles = [tokenizer.decode([token_id]) for token_id in token_ids]
    assert sum(REPLACEMENT_CHAR in single for single in singles) >= 5, "needs split characters"
    rng = random.Random(4)
    chunkings = [[1] * len(token_ids)] + [
        [rng.randint(1, 4) for _ in token_ids] for _ in range(10)
    ]
    for sizes in chunkings:
        deltas = detokenize(tokenizer, token_ids, sizes)
        assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
        assert "".join(deltas) == tokenizer.decode(token_ids) == MIXED


def test_token_bytes_on_the_default_tokenizer(tokenizer: Any) -> None:
    texts = TokenTexts(tokenizer)
    token_ids = tokenizer.encode(MIXED, add_special_tokens=False)
    assert b"".join(texts(token_id).utf8 for token_id in token_ids) == MIXED.encode()


@pytest.fixture(scope="module")
def client(float32_default_server: LaunchedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=float32_default_server.base_url + "/v1", api_key="unused",
                         max_retries=0)


def split_characters(token_bytes: list[bytes]) -> int:
    """How many tokens hold only part of a character."""
    broken = 0
    for utf8 in token_bytes:
        try:
            utf8.decode()
        except UnicodeDecodeError:
            broken += 1
    return broken


@pytest.mark.e2e
def test_chinese_chat_answer(client: openai.OpenAI) -> None:
    request = {"model": MODEL, "messages": TRANSLATE, "temperature": 0, "max_tokens": 30}
    whole = client.chat.completions.create(**request, logprobs=True)
    text = whole.choices[0].message.content
    token_bytes = [bytes(token.bytes) for token in whole.choices[0].logprobs.content]
    assert split_characters(token_bytes) >= 5
    # Byte-level BPE: decoding the generated ids is decoding their bytes.
    assert b"".join(token_bytes).decode(errors="replace") == text
    assert REPLACEMENT_CHAR not in text
    assert sum("\u4e00" <= char <= "\u9fff" for char in text) >= 10
    deltas = [
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(**request, stream=True)
    ]
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
    assert "".join(deltas) == text


@pytest.mark.e2e
def test_emoji_completion(client: openai.OpenAI) -> None:
    request = {"model": MODEL, "prompt": EMOJI_PROMPT, "temperature": 0, "max_tokens": 12}
    whole = client.completions.create(**request, logprobs=0)
    text = whole.choices[0].text
    assert "🎉" in text and REPLACEMENT_CHAR not in text
    assert sum(REPLACEMENT_CHAR in token for token in whole.choices[0].logprobs.tokens) >= 4
    deltas = [chunk.choices[0].text for chunk in client.completions.create(**request, stream=True)]
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
    assert "".join(deltas) == text
    assert len([delta for delta in deltas if delta]) > 3  # it really streamed


@pytest.mark.e2e
def test_cut_mid_character_ends_as_decode_does(client: openai.OpenAI) -> None:
    """max_tokens can end the text inside a character; both forms then end the way
    tokenizer.decode does, with one U+FFFD at the very end."""
    request = {"model": MODEL, "prompt": EMOJI_PROMPT, "temperature": 0, "max_tokens": 11}
    text = client.completions.create(**request).choices[0].text
    deltas = [chunk.choices[0].text for chunk in client.completions.create(**request, stream=True)]
    assert "".join(deltas) == text
    assert text.endswith(REPLACEMENT_CHAR) and text.count(REPLACEMENT_CHAR) == 1
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas[:-1])


@pytest.mark.e2e
def test_echo_of_a_token_id_prompt(client: openai.OpenAI, tokenizer: Any) -> None:
    prompt_ids = tokenizer.encode(MIXED, add_special_tokens=False)
    request = {"model": MODEL, "prompt": prompt_ids, "echo": True, "max_tokens": 1}
    whole = client.completions.create(**request, temperature=0).choices[0].text
    assert whole.startswith(MIXED)
    streamed = list(client.completions.create(**request, temperature=0, stream=True))
    assert streamed[0].choices[0].text.startswith(MIXED)  # with the first token
    assert "".join(chunk.choices[0].text for chunk in streamed) == whole
