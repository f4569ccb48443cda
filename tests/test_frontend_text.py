"""Incremental detokenizer and stop-string matcher, without sockets or HTTP."""

from __future__ import annotations

import random
from typing import Any

from frontend.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from frontend.stop_strings import StopStringMatcher

MIXED_TEXT = "Hello 😀 world! 你好\uff0c世界 🇫🇷 café naïve — Ωμέγα 👩‍👩‍👧 end"


def stream(tokenizer: Any, token_ids: list[int], chunk_sizes: list[int] | None = None) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = []
    position = 0
    sizes = iter(chunk_sizes or [])
    while position < len(token_ids):
        size = next(sizes, 1)
        deltas.append(detokenizer.push(token_ids[position : position + size]))
        position += size
    deltas.append(detokenizer.flush())
    return deltas


def test_multibyte_characters_split_across_tokens(tokenizer: Any) -> None:
    token_ids = tokenizer.encode(MIXED_TEXT, add_special_tokens=False)
    pieces = [tokenizer.decode([token_id]) for token_id in token_ids]
    assert any(REPLACEMENT_CHAR in piece for piece in pieces), "the test needs split characters"
    deltas = stream(tokenizer, token_ids)
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(token_ids, skip_special_tokens=True) == MIXED_TEXT


def test_random_chunking_matches_full_decode(tokenizer: Any) -> None:
    token_ids = tokenizer.encode(MIXED_TEXT * 3, add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(20):
        sizes = [rng.randint(1, 5) for _ in token_ids]
        deltas = stream(tokenizer, token_ids, sizes)
        assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
        assert "".join(deltas) == MIXED_TEXT * 3


def test_special_tokens_are_skipped(tokenizer: Any) -> None:
    text_ids = tokenizer.encode("Hello 你好", add_special_tokens=False)
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    token_ids = [*text_ids[:3], special, *text_ids[3:], special]
    deltas = stream(tokenizer, token_ids)
    assert "".join(deltas) == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert "<|im_end|>" not in "".join(deltas)


def test_incomplete_character_is_held_until_flush(tokenizer: Any) -> None:
    emoji_ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(emoji_ids) > 1
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.push(emoji_ids[:-1]) == ""
    assert detokenizer.push(emoji_ids[-1:]) == "😀"
    assert detokenizer.flush() == ""
    # A stream that ends mid-character emits what decode() gives, nothing more.
    truncated = IncrementalDetokenizer(tokenizer)
    assert truncated.push(emoji_ids[:2]) == ""
    assert truncated.flush() == tokenizer.decode(emoji_ids[:2])


def test_default_model_tokenizer_round_trip() -> None:
    from transformers import PreTrainedTokenizerFast

    from common.default_model import resolve_model

    tokenizer = PreTrainedTokenizerFast.from_pretrained(resolve_model(None))
    token_ids = tokenizer.encode(MIXED_TEXT, add_special_tokens=False)
    deltas = stream(tokenizer, token_ids)
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(token_ids, skip_special_tokens=True)


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, bool]:
    emitted = []
    for delta in deltas:
        result = matcher.feed(delta)
        emitted.append(result.text)
        if result.stopped:
            return "".join(emitted), True
    return "".join(emitted) + matcher.flush(), False


def test_stop_string_split_across_deltas() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc S").text == "abc "
    assert matcher.feed("T").text == ""
    result = matcher.feed("OP and more")
    assert result.stopped and result.text == ""


def test_partial_match_that_fails_is_released() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("ST").text == ""
    assert matcher.feed("ART").text == "START"


def test_earliest_of_several_stop_strings_wins() -> None:
    assert feed_all(StopStringMatcher(["world", "lo"]), ["hello ", "world"]) == ("hel", True)


def test_held_text_is_flushed_when_no_stop_follows() -> None:
    assert feed_all(StopStringMatcher(["END"]), ["the E", "N"]) == ("the EN", False)


def test_no_stop_strings_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("anything").text == "anything"
    assert matcher.flush() == ""
