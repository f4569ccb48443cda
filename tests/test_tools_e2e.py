"""Tool calling through the official openai SDK against launch.py on the default model
(SmolLM2, whose chat template takes no tools: the built-in Hermes prompt and parser)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.launched_server import LaunchedServer

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30},
                   "unit": {"enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                      "description": "The weather forecast for a city."}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 30}},
                                          "required": ["city"],
                                          "additionalProperties": False}}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What will the weather be in Paris this week?"}]

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(default_server: LaunchedServer) -> LaunchedServer:
    return default_server


@pytest.fixture(scope="module")
def client(server: LaunchedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def assert_valid_call(call, names: set[str]) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize(("tool_choice", "parallel"), [
    ("named", True), ("named", False), ("required", False)])
def test_one_call_and_its_end_twenty_times_out_of_twenty(client: openai.OpenAI,
                                                         tool_choice: str,
                                                         parallel: bool) -> None:
    """A named function, or parallel_tool_calls false: one call, then the reply ends."""
    choice = NAMED_TIME if tool_choice == "named" else tool_choice
    completion = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
        parallel_tool_calls=parallel, temperature=1.0, n=20, seed=11,
        max_completion_tokens=120)
    names = {"get_time"} if tool_choice == "named" else set(SCHEMAS)
    for result in completion.choices:
        assert result.finish_reason == "tool_calls"
        assert result.message.content is None
        (call,) = result.message.tool_calls
        assert_valid_call(call, names)


def test_a_named_choice_streams_one_call_and_no_empty_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED_TIME, temperature=0,
        max_completion_tokens=120, stream=True, stream_options={"include_usage": True}))
    *choice_chunks, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens > 0
    for chunk in choice_chunks:
        delta = chunk.choices[0].delta
        assert delta.content or delta.tool_calls or chunk.choices[0].finish_reason, chunk
    parts = [part for chunk in choice_chunks for part in chunk.choices[0].delta.tool_calls or ()]
    assert {part.index for part in parts} == {0}
    assert [part.function.name for part in parts if part.function.name] == ["get_time"]
    assert choice_chunks[-1].choices[0].finish_reason == "tool_calls"
    assert choice_chunks[0].choices[0].delta.role == "assistant"
    assert_valid_call(openai.types.chat.ChatCompletionMessageToolCall(
        id=parts[0].id, type="function", function={"name": "get_time", "arguments": "".join(
            part.function.arguments for part in parts)}), {"get_time"})


def test_required_parallel_calls_may_end_and_never_leave_a_call_in_content(
        client: openai.OpenAI, capsys: pytest.CaptureFixture) -> None:
    """Several calls allowed: whether the model ends before max_tokens is its choice
    (reported, not asserted); a call cut short by max_tokens is never content."""
    completion = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0,
        n=20, seed=3, max_completion_tokens=150)
    ended = 0
    for result in completion.choices:
        assert result.message.content is None
        calls = result.message.tool_calls
        assert calls and result.finish_reason in ("tool_calls", "length")
        ended += result.finish_reason == "tool_calls"
        whole = calls if result.finish_reason == "tool_calls" else calls[:-1]
        for call in whole:
            assert_valid_call(call, set(SCHEMAS))
    with capsys.disabled():
        print(f"\nrequired, parallel calls: {ended} of 20 replies ended before max_tokens")


def test_streamed_tool_call_deltas_reassemble_to_the_whole_reply(client: openai.OpenAI) -> None:
    settings = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
                "temperature": 0, "max_completion_tokens": 300}
    whole = client.chat.completions.create(**settings).choices[0]
    assert len(whole.message.tool_calls) >= 2
    calls: dict[int, dict] = {}
    finish_reason, content = None, ""
    for chunk in client.chat.completions.create(**settings, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    assert finish_reason == whole.finish_reason
    assert content == (whole.message.content or "")
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_a_two_turn_conversation_with_a_tool_result(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=False, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_completion_tokens=120).choices[0].message
    (call,) = first.tool_calls
    messages = [*ASK, first.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id,
                 "content": json.dumps({"forecast": "sunny", "high": 24})}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                            tool_choice="none", temperature=0,
                                            max_completion_tokens=60).choices[0]
    assert second.message.content and not second.message.tool_calls
    assert second.finish_reason in ("stop", "length")


def test_tool_choice_none_gives_plain_text(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                            tool_choice="none", temperature=0,
                                            max_completion_tokens=40).choices[0]
    assert result.message.content and result.message.tool_calls is None


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_answers_in_text_or_whole_calls_and_streams_no_empty_chunk(
        client: openai.OpenAI, parallel: bool) -> None:
    """Under "auto" the grammar leaves text free; a call once begun is whole and valid."""
    settings = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 1.0,
                "max_completion_tokens": 100, "parallel_tool_calls": parallel}

    def whole(seed: int):
        return client.chat.completions.create(**settings, seed=seed).choices[0]

    def streamed(seed: int) -> list:
        return list(client.chat.completions.create(**settings, seed=seed, stream=True))

    seeds = range(4)
    with ThreadPoolExecutor(max_workers=8) as pool:  # one batch, not eight requests in turn
        results, streams = pool.map(whole, seeds), pool.map(streamed, seeds)
        results, streams = list(results), list(streams)
    for result in results:
        assert "<tool_call>" not in (result.message.content or "")
        calls = result.message.tool_calls or []
        assert len(calls) <= (8 if parallel else 1)
        if result.finish_reason == "tool_calls":
            for call in calls:
                assert_valid_call(call, set(SCHEMAS))
    for chunk in (chunk for stream in streams for chunk in stream):
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason
        assert delta.content or delta.tool_calls or finish, chunk


def test_auto_reads_a_call_the_model_makes(client: openai.OpenAI) -> None:
    """A 135M model rarely calls on its own: a grammar makes it write one, tool_choice
    "auto" must read it back as a call, streamed and not."""
    forced = ('start: "<tool_call>\\n" %json {"type": "object", "properties": {'
              '"name": {"const": "get_time"}, "arguments": {"type": "object", "properties": '
              '{"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"], '
              '"additionalProperties": false}}, "required": ["name", "arguments"], '
              '"additionalProperties": false} "\\n</tool_call>"')
    settings = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "auto",
                "temperature": 0, "max_completion_tokens": 80,
                "extra_body": {"structured_outputs": {"grammar": forced}}}
    result = client.chat.completions.create(**settings).choices[0]
    assert result.finish_reason == "tool_calls"
    (call,) = result.message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    chunks = list(client.chat.completions.create(**settings, stream=True))
    parts = [part for chunk in chunks for part in chunk.choices[0].delta.tool_calls or ()]
    assert {part.index for part in parts} == {0} and len(parts) > 2  # arguments in fragments
    assert parts[0].function.name == "get_time" and parts[0].id.startswith("call_")
    assert "".join(part.function.arguments for part in parts) == call.function.arguments


BAD_TOOL_REQUESTS = [  # (body fields, the error's param)
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools[0].function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": [*ASK, {"role": "tool", "content": "24 C"}]}, "messages[1].tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"type": "function"}]}]},
     "messages[1].tool_calls[0]"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_TOOL_REQUESTS,
                         ids=[f"{i}-{param}" for i, (_, param) in enumerate(BAD_TOOL_REQUESTS)])
def test_malformed_tool_request_is_a_400_naming_the_field(client: openai.OpenAI, fields: dict,
                                                          param: str) -> None:
    body = {"messages": ASK, **fields}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, max_completion_tokens=5,
                                       messages=body.pop("messages"), extra_body=body)
    assert raised.value.body["param"] == param, raised.value.body
    assert client.chat.completions.create(model=MODEL, messages=ASK, max_completion_tokens=3)


def test_json_numbers_end_so_parse_succeeds(client: openai.OpenAI) -> None:
    """The issue's case: without bounds SmolLM2 wrote a population of 150+ digits."""
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str
        population: int

    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris."}],
        response_format=City, temperature=0, max_tokens=200)
    city = completion.choices[0].message.parsed
    assert completion.choices[0].finish_reason == "stop"
    assert city is not None and abs(city.population) < 10**19
