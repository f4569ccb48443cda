"""The grammars a reply with tools follows (frontend.tools.call_grammar) and the number bounds
of JSON output (frontend.json_bounds), checked by llguidance itself on whole replies: what
each tool_choice and parallel_tool_calls lets a reply say, and where it may end."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from frontend.json_bounds import NumberBounds
from frontend.structured_outputs import StructuredOutput, build_grammars
from frontend.tools import call_grammar, parse_tool_request

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "echo", "parameters": {
             "type": "object", "properties": {"text": {"type": "string"}},
             "required": ["text"], "additionalProperties": False}}}]
NAMED = {"type": "function", "function": {"name": "add"}}


def hermes(arguments: str = '{"a": 1, "b": 2.5}', name: str = "add") -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def llama3(arguments: str = '{"a": 1, "b": 2.5}') -> str:
    return f'{{"name": "add", "parameters": {arguments}}}'


@pytest.fixture(scope="module")
def llg_tokenizer(tokenizer: Any) -> Any:
    from llguidance.hf import from_tokenizer

    return from_tokenizer(tokenizer, eos_token=tokenizer.eos_token_id)


def reply_holds(llg_tokenizer: Any, tokenizer: Any, grammars: list[str], reply: str) -> bool:
    """Every grammar accepts the reply's tokens and then the end of sequence."""
    from llguidance import LLMatcher

    for grammar in grammars:
        matcher = LLMatcher(llg_tokenizer, grammar)
        tokens = [*tokenizer.encode(reply, add_special_tokens=False), tokenizer.eos_token_id]
        if not all(matcher.consume_token(token) for token in tokens):
            return False
    return True


def tool_grammars(parser: str, **fields: Any) -> list[str]:
    request = parse_tool_request({"tools": TOOLS, **fields})
    assert request is not None
    structured = call_grammar(request, parser)
    assert structured is not None
    return build_grammars(structured)


HERMES_CASES = [  # (tool_choice, parallel_tool_calls, reply, holds)
    (NAMED, True, hermes(), True),
    (NAMED, True, hermes() + "\n" + hermes(), False),
    (NAMED, True, hermes(name="echo", arguments='{"text": "hi"}'), False),
    (NAMED, False, hermes(), True),
    ("required", True, hermes() + "\n" + hermes(name="echo", arguments='{"text": "x"}'), True),
    ("required", True, hermes() + "\n\n" + hermes(), False),
    ("required", True, "\n" + hermes(), False),
    ("required", True, hermes() + " ", False),
    ("required", True, "Sure. " + hermes(), False),
    ("required", True, "", False),
    ("required", False, hermes(), True),
    ("required", False, hermes() + "\n" + hermes(), False),
    ("auto", True, "It is 3.", True),
    ("auto", True, "", True),
    ("auto", True, "Let me add.\n" + hermes() + "\n" + hermes(), True),
    ("auto", True, hermes() + "\nDone.", False),
    ("auto", True, "Let me add. <tool_call>\n{oops}\n</tool_call>", False),
    ("auto", False, hermes(), True),
    ("auto", False, hermes() + "\n" + hermes(), False),
    ("required", True, hermes('{"a": 1234567890123456789, "b": 0.5}'), True),
    ("required", True, hermes('{"a": 12345678901234567890, "b": 0.5}'), False),
    ("auto", True, hermes('{"a": 1, "b": 1.2345678901234567e-300}'), True),
    ("auto", True, hermes('{"a": 1, "b": 1.23456789012345678}'), False),
    ("auto", True, hermes('{"a": 1, "b": 1e1000}'), False),
    ("auto", True, "12345678901234567890123 apples: " + hermes(), True),
    ("required", True, hermes(name="echo", arguments='{"text": "12345678901234567890123"}'),
     True),
]


@pytest.mark.parametrize(("choice", "parallel", "reply", "holds"), HERMES_CASES,
                         ids=[f"{i}-{c if isinstance(c, str) else 'named'}-{p}"
                              for i, (c, p, _, _) in enumerate(HERMES_CASES)])
def test_hermes_replies(llg_tokenizer: Any, tokenizer: Any, choice: Any, parallel: bool,
                        reply: str, holds: bool) -> None:
    grammars = tool_grammars("hermes", tool_choice=choice, parallel_tool_calls=parallel)
    assert reply_holds(llg_tokenizer, tokenizer, grammars, reply) is holds


LLAMA3_CASES = [
    (NAMED, True, llama3(), True),
    (NAMED, True, llama3() + "; " + llama3(), False),
    ("required", True, llama3() + "; " + llama3(), True),
    ("required", False, llama3() + "; " + llama3(), False),
    ("auto", True, "Plain words.", True),
    ("auto", True, llama3(), True),
    ("auto", True, "{oops}", False),
    ("auto", True, llama3('{"a": 99999999999999999999, "b": 1}'), False),
]


@pytest.mark.parametrize(("choice", "parallel", "reply", "holds"), LLAMA3_CASES)
def test_llama3_json_replies(llg_tokenizer: Any, tokenizer: Any, choice: Any, parallel: bool,
                             reply: str, holds: bool) -> None:
    grammars = tool_grammars("llama3_json", tool_choice=choice, parallel_tool_calls=parallel)
    assert reply_holds(llg_tokenizer, tokenizer, grammars, reply) is holds


def test_auto_leaves_a_schema_llguidance_cannot_enforce_unconstrained() -> None:
    """Under "auto" a tool whose schema llguidance refuses still serves (no grammar);
    "required" names the tool in a 400 (tests/test_tools_e2e.py)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}]
    request = parse_tool_request({"tools": tools})
    assert request is not None
    structured = call_grammar(request, "hermes")
    assert structured is not None and structured.optional
    assert len(build_grammars(structured)) in (0, 2)  # lenient: built, or left out


JSON_CASES = [  # (schema, reply, holds)
    ({"type": "object"}, '{"population": 2148000}', True),
    ({"type": "object"}, '{"population": 11111111111111111111111}', False),
    ({"type": "object"}, '{"id": "11111111111111111111111"}', True),
    ({"type": "object"}, '{"x": [0.5, -3e-7, 1E+10, 0, -0.0]}', True),
    ({"type": "object"}, '{"x": 0.00000000000000001}', True),
    ({"type": "object"}, '{"x": 0.0000000000000000001}', False),
    ({"type": "integer", "minimum": 10**17}, str(10**18 + 7), True),
    ({"type": "integer", "minimum": 10**17}, str(10**19 + 7), False),
    ({"type": "number", "maximum": 1e-20, "exclusiveMinimum": 0}, "0.000000000000000000005",
     True),
    ({"type": "number", "maximum": 1e-20, "exclusiveMinimum": 0}, "0.0000000000000000000005",
     False),
]


@pytest.mark.parametrize(("schema", "reply", "holds"), JSON_CASES)
def test_json_numbers_are_bounded_unless_the_schema_says_otherwise(
        llg_tokenizer: Any, tokenizer: Any, schema: dict, reply: str, holds: bool) -> None:
    grammars = build_grammars(StructuredOutput("response_format", "json", schema))
    assert len(grammars) == 2
    assert reply_holds(llg_tokenizer, tokenizer, grammars, reply) is holds


def test_bounds_widen_to_the_schemas_small_numbers() -> None:
    assert NumberBounds.of([{"type": "integer", "minimum": 10**18}]) == NumberBounds(16)
    widened = NumberBounds.of([{"properties": {"tiny": {"maximum": -1e-20}},
                                "items": {"enum": [1e-25, "x", True]}}])
    assert widened == NumberBounds(25)


@pytest.mark.parametrize(("number", "bounded"), [
    ("0", True), ("-0", True), ("9223372036854775807", True), ("1" * 20, False),
    ("3.1415926535897932", True), ("3.14159265358979323", False), ("1e308", True),
    ("1e-1000", False), ("12345678901234567.5", False), ("0.000012345678901234567", True),
    ("01", False), ("1.", False), (".5", False)])
def test_the_number_regex(number: str, bounded: bool) -> None:
    assert bool(re.fullmatch(NumberBounds().number_regex, number)) is bounded
    if bounded:
        json.loads(number)
