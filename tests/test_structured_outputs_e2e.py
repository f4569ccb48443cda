"""Structured outputs through the official openai SDK and plain HTTP, against launch.py on
the default model: the output matches the schema, regex, choice or grammar every time, at
temperature 1 too; streaming equals non-streaming; every malformed request is a 400 naming
its field, and the server keeps serving."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from bench.structured import slow_grammar
from tests.launched_server import LaunchedServer

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Write an order for two apples as JSON."}]

pytestmark = pytest.mark.e2e


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid")  # strict mode: no object takes other keys

    name: str = Field(max_length=20)
    quantity: int = Field(ge=1, le=9)


class Order(BaseModel):
    status: Literal["new", "paid", "shipped"]
    items: list[Item] = Field(min_length=1, max_length=3)
    total: float = Field(ge=0, le=1000)
    gift: bool


ORDER_SCHEMA = {**Order.model_json_schema(), "additionalProperties": False}
ORDER_FORMAT = {"type": "json_schema",
                "json_schema": {"name": "order", "schema": ORDER_SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    launched = LaunchedServer(["--grammar-compile-timeout", "0.3"]).start(
        tmp_path_factory.mktemp("logs"))
    yield launched
    assert launched.stop() == 0, launched.log


@pytest.fixture(scope="module")
def client(server: LaunchedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Order,
                                               temperature=0, max_completion_tokens=200)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Order)


def test_twenty_sampled_choices_all_validate(client: openai.OpenAI) -> None:
    """One request, n=20 at temperature 1: every choice has its own matcher."""
    completion = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=ORDER_FORMAT, temperature=1.0, n=20,
        max_completion_tokens=300, seed=7)
    assert len(completion.choices) == 20
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), ORDER_SCHEMA)


def test_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    settings = {"model": MODEL, "messages": ASK, "response_format": ORDER_FORMAT,
                "temperature": 0, "max_completion_tokens": 200}
    whole = client.chat.completions.create(**settings).choices[0].message.content
    chunks = list(client.chat.completions.create(**settings, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole), ORDER_SCHEMA)


def test_json_object_regex_choice_and_grammar_conform(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat."}],
        response_format={"type": "json_object"}, temperature=0, max_completion_tokens=150)
    assert isinstance(json.loads(chat.choices[0].message.content), dict)

    def complete(prompt: str, **extra) -> str:
        result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40,
                                           temperature=1.0, seed=3, extra_body=extra)
        assert result.choices[0].finish_reason == "stop"
        return result.choices[0].text

    phone = r"\(?[0-9]{3}\)? [0-9]{3}-[0-9]{4}"
    assert re.fullmatch(phone, complete("Call me at", structured_outputs={"regex": phone}))
    assert complete("Is the sky blue?", structured_outputs={
        "choice": ["yes", "no", "maybe"]}) in ("yes", "no", "maybe")
    answer = complete("Add 2 and 3:", structured_outputs={
        "grammar": 'start: NUMBER " + " NUMBER " = " NUMBER\nNUMBER: /[0-9]{1,3}/'})
    assert re.fullmatch(r"[0-9]{1,3} \+ [0-9]{1,3} = [0-9]{1,3}", answer)
    assert complete("Pick:", guided_choice=["left", "right"]) in ("left", "right")


BAD_REQUESTS = [  # (body fields, the error's param)
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format.json_schema.schema"),  # a keyword llguidance cannot enforce
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "a(?=b)"}}}},
     "response_format.json_schema.schema"),  # look-ahead: not enforceable
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frobnicate"}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
     "response_format"),
    ({"structured_outputs": "a+"}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": 'root ::= ("a"'}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": 'start: "a" ))'}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"yaml": "a: 1"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["x" * 1024] * 5000}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a+"}, "guided_regex": "b+"}, "guided_regex"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_REQUESTS,
                         ids=[f"{i}-{param}" for i, (_, param) in enumerate(BAD_REQUESTS)])
def test_malformed_structured_output_is_a_400_naming_the_field(
        client: openai.OpenAI, fields: dict, param: str) -> None:
    for endpoint in ("chat", "completions"):
        with pytest.raises(openai.BadRequestError) as raised:
            if endpoint == "chat":
                client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5,
                                               extra_body=fields)
            else:
                client.completions.create(model=MODEL, prompt="x", max_tokens=5,
                                          extra_body=fields)
        assert raised.value.status_code == 400
        error = raised.value.body
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert error["message"]
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text


def test_a_grammar_over_the_compile_time_limit_is_a_400_and_others_go_on(
        client: openai.OpenAI) -> None:
    """The server runs with --grammar-compile-timeout 0.3; this grammar takes ~1 s."""
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={
            "structured_outputs": {"grammar": slow_grammar(30_000)}})
    assert "more than 0.3 s to compile" in raised.value.body["message"]
    after = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=5,
                                      extra_body={"structured_outputs": {"choice": ["a", "b"]}})
    assert after.choices[0].text in ("a", "b")
