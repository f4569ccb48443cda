"""Anthropic's Messages API through the official `anthropic` SDK against launch.py on the
default model: plain, streamed, stop sequences, a tool loop, count_tokens; the same
conversation answers as it does on /v1/chat/completions (one path behind both)."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from tests.agent_apis import API_KEY, INSTRUCTIONS, MODEL, QUESTION, WEATHER, WEATHER_QUESTION
from tests.launched_server import LaunchedServer

ASK = [{"role": "user", "content": QUESTION}]
TOOLS = [{"name": "get_weather", "description": "The weather in a city now.",
          "input_schema": WEATHER}]
ASK_WEATHER = [{"role": "user", "content": WEATHER_QUESTION}]
# Recent SDKs dropped the sampling keywords; the API (and Loom) still take them in the body.
GREEDY = {"extra_body": {"temperature": 0}}
ONE_CALL = {"type": "any", "disable_parallel_tool_use": True}

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(keyed_default_server: LaunchedServer) -> LaunchedServer:
    return keyed_default_server


@pytest.fixture(scope="module")
def client(server: LaunchedServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0)


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_a_message_is_the_chat_completion_of_the_same_conversation(
        client: anthropic.Anthropic, server: LaunchedServer) -> None:
    message = client.messages.create(model=MODEL, system=INSTRUCTIONS, messages=ASK, max_tokens=40,
                                     **GREEDY)
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == MODEL
    assert message.stop_reason in ("end_turn", "max_tokens")
    chat = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY).chat.completions
    completion = chat.create(model=MODEL, max_tokens=40, **GREEDY,
                             messages=[{"role": "system", "content": INSTRUCTIONS}, *ASK])
    assert text_of(message) == completion.choices[0].message.content
    assert message.usage.input_tokens == completion.usage.prompt_tokens
    assert message.usage.output_tokens == completion.usage.completion_tokens
    counted = client.messages.count_tokens(model=MODEL, system=INSTRUCTIONS, messages=ASK)
    assert counted.input_tokens == message.usage.input_tokens


def test_a_streamed_message_reassembles_to_the_whole_one(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model=MODEL, messages=ASK, max_tokens=30, **GREEDY)
    with client.messages.stream(model=MODEL, messages=ASK, max_tokens=30,
                                **GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[1] == "content_block_start" and "content_block_delta" in kinds
    assert kinds[-3:-1] == ["content_block_stop", "message_delta"]
    assert text_of(final) == text_of(whole)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_ends_the_text_before_it_and_is_named(
        client: anthropic.Anthropic) -> None:
    whole = text_of(client.messages.create(model=MODEL, messages=ASK, max_tokens=40,
                                           **GREEDY))
    words = whole.split()
    assert len(words) >= 3, whole
    stop = " " + words[2]
    for stream in (False, True):
        if stream:
            with client.messages.stream(model=MODEL, messages=ASK, max_tokens=40,
                                        **GREEDY, stop_sequences=[stop]) as streamed:
                message = streamed.get_final_message()
        else:
            message = client.messages.create(model=MODEL, messages=ASK, max_tokens=40,
                                             **GREEDY, stop_sequences=[stop])
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
        assert text_of(message) == whole[:whole.index(stop)]


def test_a_tool_loop(client: anthropic.Anthropic) -> None:
    """A forced call with valid input, its result sent back, then an answer in text."""
    first = client.messages.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS,
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   max_tokens=80, **GREEDY)
    assert first.stop_reason == "tool_use"
    (call,) = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)
    follow_up = [*ASK_WEATHER,
                 {"role": "assistant", "content": [block.model_dump() for block in
                                                   first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": "Sunny, 21 degrees."}]}]
    answer = client.messages.create(model=MODEL, messages=follow_up, tools=TOOLS,
                                    tool_choice={"type": "none"}, max_tokens=40,
                                    **GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert text_of(answer) and not [b for b in answer.content if b.type == "tool_use"]
    assert answer.usage.input_tokens > first.usage.input_tokens


def test_a_streamed_tool_call_sends_its_input_as_json_deltas(
        client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS,
                                   tool_choice=ONE_CALL, max_tokens=80, **GREEDY)
    fragments = []
    with client.messages.stream(model=MODEL, messages=ASK_WEATHER, tools=TOOLS,
                                tool_choice=ONE_CALL, max_tokens=80,
                                **GREEDY) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                fragments.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert len(fragments) > 1
    (call,) = [block for block in final.content if block.type == "tool_use"]
    (whole_call,) = [block for block in whole.content if block.type == "tool_use"]
    assert json.loads("".join(fragments)) == call.input == whole_call.input
    assert final.stop_reason == "tool_use"


def test_a_wrong_key_is_an_authentication_error(server: LaunchedServer) -> None:
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model=MODEL, messages=ASK, max_tokens=5)
    assert caught.value.body["error"]["type"] == "authentication_error"
