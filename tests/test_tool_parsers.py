"""Tool-call parsers (frontend.tool_parsers): whole replies, and the same replies streamed
in every possible split, which must reassemble to the whole-reply result."""

from __future__ import annotations

import json

import pytest

from frontend.tool_parsers import ParsedPiece, make_parser, parse_reply

CALL = '{"name": "get_weather", "arguments": {"city": "Paris; France", "unit": "celsius"}}'
HERMES_REPLIES = {
    "one call": (f"<tool_call>\n{CALL}\n</tool_call>", None, ["get_weather"]),
    "text then calls": (f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>{CALL}"
                        "</tool_call>\n", "Let me check.", ["get_weather", "get_weather"]),
    "text around": (f"A <tool_call>{CALL}</tool_call> B", "A  B", ["get_weather"]),
    "plain text": ("It is sunny in <b>Paris</b>.", "It is sunny in <b>Paris</b>.", []),
    "bad json stays content": ("<tool_call>{oops}</tool_call>",
                               "<tool_call>{oops}</tool_call>", []),
    "whole but for its close marker": (f"<tool_call>\n{CALL}\n</tool_", None, ["get_weather"]),
    "marker prefix at the end": ("Hello <tool_ca", "Hello <tool_ca", []),
    "other layout, sent whole": ('<tool_call>{"arguments": {"city": "Paris; France", '
                                 '"unit": "celsius"}, "name": "get_weather"}</tool_call>',
                                 None, ["get_weather"]),
}


def test_hermes_streams_argument_fragments_as_they_come() -> None:
    parser = make_parser("hermes")
    pieces = [parser.feed(text) for text in (
        "<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Pa',
        'ris", "unit": {"x": 1}', "}", "}\n</tool_", "call>")]
    first, = pieces[2].deltas[:1]
    assert first.call is not None and first.call.name == "get_weather"
    fragments = [delta.arguments for piece in pieces for delta in piece.deltas]
    assert fragments == ["", '{"city": "Pa', 'ris", "unit": {"x": 1', "}}"]
    assert pieces[-1].calls[0].arguments == '{"city": "Paris", "unit": {"x": 1}}'


def streamed(name: str, text: str, cuts: list[int]) -> ParsedPiece:
    parser = make_parser(name)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    result = ParsedPiece()
    for piece in [*(parser.feed(p) for p in pieces), parser.finish()]:
        result.extend(piece)
    return result


def reassembled(deltas) -> list[tuple[str, str, str]]:
    """(id, name, arguments) per call, from streamed deltas as a client joins them."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        call = calls.setdefault(delta.index, ["", "", ""])
        if delta.call is not None:
            assert call == ["", "", ""], "a call is named once, on its first delta"
            call[0], call[1] = delta.call.id, delta.call.name
        call[2] += delta.arguments
    return [tuple(calls[index]) for index in sorted(calls)]


@pytest.mark.parametrize("case", HERMES_REPLIES)
def test_hermes_whole_and_streamed_in_every_split(case: str) -> None:
    text, content, names = HERMES_REPLIES[case]
    whole = parse_reply("hermes", text)
    assert [call.name for call in whole.calls] == names
    assert (whole.content or None) == content
    for call in whole.calls:
        assert json.loads(call.arguments) == {"city": "Paris; France", "unit": "celsius"}
    assert reassembled(whole.deltas) == [(c.id, c.name, c.arguments) for c in whole.calls]
    for cut in range(1, len(text)):
        for second in (cut + 3, cut + 17):
            cuts = [cut] if second >= len(text) else [cut, second]
            split = streamed("hermes", text, cuts)
            assert split.content == whole.content, (cuts, split.content)
            assert [(c.name, c.arguments) for c in split.calls] == \
                [(c.name, c.arguments) for c in whole.calls]
            assert reassembled(split.deltas) == [(c.id, c.name, c.arguments)
                                                 for c in split.calls]


@pytest.mark.parametrize(("text", "content", "arguments"), [
    (f"Let me see. <tool_call>\n{CALL[:30]}", "Let me see.", None),
    (f"<tool_call>\n{CALL[:60]}", None, '{"city": "Paris; France'),
    (f"<tool_call>\n{CALL[:-1]}", None, '{"city": "Paris; France", "unit": "celsius"}'),
])
def test_a_block_cut_short_is_never_content(text: str, content: str | None,
                                            arguments: str | None) -> None:
    """max_tokens cut the reply inside a call: named, the call keeps what was written (as
    streamed); not yet named, it is dropped."""
    whole = parse_reply("hermes", text)
    assert (whole.content or None) == content
    assert [call.arguments for call in whole.calls] == ([] if arguments is None else [arguments])
    for cut in range(1, len(text)):
        split = streamed("hermes", text, [cut])
        assert split.content == whole.content
        assert reassembled(split.deltas) == [(c.id, c.name, c.arguments) for c in split.calls]
        assert [c.arguments for c in split.calls] == [c.arguments for c in whole.calls]


def test_a_marker_begun_at_max_tokens_is_dropped_but_kept_at_a_stop() -> None:
    text = f"<tool_call>\n{CALL}\n</tool_call>\n<tool"
    cut = parse_reply("hermes", text, cut_short=True)
    assert cut.content == "" and [call.name for call in cut.calls] == ["get_weather"]
    assert parse_reply("hermes", text).content.strip() == "<tool"
    assert parse_reply("hermes", "Say <tool", cut_short=True).content == "Say"


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'


@pytest.mark.parametrize(("text", "names", "content"), [
    (LLAMA_CALL, ["get_weather"], ""),
    (f"<|python_tag|>{LLAMA_CALL}; {LLAMA_CALL}", ["get_weather", "get_weather"], ""),
    ("The weather is fine.", [], "The weather is fine."),
    ('{"not": "a call"}', [], '{"not": "a call"}'),
])
def test_llama3_json_whole_and_streamed(text: str, names: list[str], content: str) -> None:
    whole = parse_reply("llama3_json", text)
    assert [call.name for call in whole.calls] == names
    assert whole.content == content
    for cut in range(1, len(text)):
        split = streamed("llama3_json", text, [cut])
        assert split.content == whole.content
        assert [c.arguments for c in split.calls] == [c.arguments for c in whole.calls]
        assert reassembled(split.deltas) == [(c.id, c.name, c.arguments) for c in split.calls]
