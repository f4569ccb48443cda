"""OpenAI's Responses API through the official `openai` SDK (and one agent of the OpenAI Agents
SDK) against launch.py on the default model: create, stream, parse, a two-turn function-call
loop, stored responses; the same conversation answers as on /v1/chat/completions."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

from tests.agent_apis import API_KEY, INSTRUCTIONS, MODEL, QUESTION, WEATHER
from tests.agent_apis import WEATHER_QUESTION as ASK_WEATHER
from tests.launched_server import LaunchedServer

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": WEATHER}]

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(keyed_default_server: LaunchedServer) -> LaunchedServer:
    return keyed_default_server


@pytest.fixture(scope="module")
def client(server: LaunchedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)


def test_a_response_is_the_chat_completion_of_the_same_conversation(
        client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION,
                                       max_output_tokens=40, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    completion = client.chat.completions.create(
        model=MODEL, max_tokens=40, temperature=0,
        messages=[{"role": "system", "content": INSTRUCTIONS},
                  {"role": "user", "content": QUESTION}])
    assert response.output_text == completion.choices[0].message.content
    assert response.usage.input_tokens == completion.usage.prompt_tokens
    assert response.usage.output_tokens == completion.usage.completion_tokens
    cut = completion.choices[0].finish_reason == "length"
    assert (response.status == "incomplete") == cut


def test_a_streamed_response_sends_semantic_events_and_reassembles(
        client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=30,
                                    temperature=0, store=False)
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=30,
                                 temperature=0, store=False) as stream:
        events = list(stream)
    final = events[-1].response  # get_final_response() wants response.completed only
    assert final.status == whole.status
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text


class Colour(pydantic.BaseModel):
    name: str
    hex_code: str


def test_parse_fills_a_pydantic_model(client: openai.OpenAI) -> None:
    response = client.responses.parse(model=MODEL, input="Describe the colour red as JSON.",
                                      text_format=Colour, max_output_tokens=60, temperature=0)
    assert isinstance(response.output_parsed, Colour)


@pytest.mark.parametrize("continued", [True, False], ids=["previous_response_id", "items"])
def test_a_two_turn_function_call_loop(client: openai.OpenAI, continued: bool) -> None:
    first = client.responses.create(model=MODEL, input=ASK_WEATHER, tools=TOOLS,
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=80, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": "Sunny, 21 degrees."}
    if continued:
        second = client.responses.create(model=MODEL, previous_response_id=first.id,
                                         input=[result], tools=TOOLS, tool_choice="none",
                                         max_output_tokens=40, temperature=0)
    else:
        items = [{"role": "user", "content": ASK_WEATHER},
                 {"type": "function_call", "call_id": call.call_id, "name": call.name,
                  "arguments": call.arguments}, result]
        second = client.responses.create(model=MODEL, input=items, tools=TOOLS,
                                         tool_choice="none", max_output_tokens=40,
                                         temperature=0)
    assert second.output_text
    assert not [item for item in second.output if item.type == "function_call"]
    assert second.usage.input_tokens > first.usage.input_tokens


def test_a_streamed_function_call_sends_its_arguments_as_deltas(client: openai.OpenAI) -> None:
    forced = {"type": "function", "name": "get_weather"}
    whole = client.responses.create(model=MODEL, input=ASK_WEATHER, tools=TOOLS,
                                    tool_choice=forced, max_output_tokens=80, temperature=0)
    with client.responses.stream(model=MODEL, input=ASK_WEATHER, tools=TOOLS,
                                 tool_choice=forced, max_output_tokens=80,
                                 temperature=0) as stream:
        events = list(stream)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [item.type for item in added] == ["function_call"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 1 and "".join(deltas) == done.arguments
    (call,) = [item for item in whole.output if item.type == "function_call"]
    assert json.loads(done.arguments) == json.loads(call.arguments)
    assert events[-1].type == "response.completed"


def test_stored_responses_are_read_and_deleted_and_unknown_ids_are_404(
        client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=5)
    assert client.responses.retrieve(response.id).output_text == response.output_text
    client.responses.delete(response.id)
    for call in (lambda: client.responses.retrieve(response.id),
                 lambda: client.responses.create(model=MODEL, input="Hi",
                                                 previous_response_id=response.id)):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert response.id in caught.value.body["message"]
    unstored = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=5,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_an_agent_of_the_agents_sdk_calls_its_tool(server: LaunchedServer) -> None:
    import agents

    agents.set_tracing_disabled(True)  # no traces sent anywhere
    calls: list[tuple[str, str]] = []

    @agents.function_tool
    def get_weather(city: str, unit: str) -> str:
        """The weather in a city, in celsius or fahrenheit."""
        calls.append((city, unit))
        return f"Sunny in {city}."

    model = agents.OpenAIResponsesModel(
        MODEL, openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY,
                                  max_retries=0))
    agent = agents.Agent(name="weather", instructions=INSTRUCTIONS, tools=[get_weather],
                         model=model, tool_use_behavior="stop_on_first_tool",
                         model_settings=agents.ModelSettings(
                             tool_choice="required", parallel_tool_calls=False, temperature=0,
                             max_tokens=100))
    result = agents.Runner.run_sync(agent, ASK_WEATHER, max_turns=2)
    assert len(calls) == 1
    assert result.final_output == f"Sunny in {calls[0][0]}."
