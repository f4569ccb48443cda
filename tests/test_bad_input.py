"""Bad input over real HTTP against a launch.py server (API key set, small body cap): each
request gets the right 4xx with an OpenAI error body, and the server keeps serving."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.launched_server import LaunchedServer
from tests.tiny_server import TINY_MODEL_NAME, shared_tiny_model, tiny_server

pytestmark = pytest.mark.e2e

API_KEY = "sk-loom-test-key"
MAX_BODY_BYTES = 64 * 1024
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
EMBEDDINGS = "/v1/embeddings"
USER = [{"role": "user", "content": "Hi"}]


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: Any = None  # a dict/list is sent as JSON; bytes as they are
    status: int = 400
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=lambda: dict(AUTH))
    method: str = "POST"


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": TINY_MODEL_NAME, "messages": USER, "max_tokens": 2} | fields


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": TINY_MODEL_NAME, "prompt": "Hi", "max_tokens": 2} | fields


def response(**fields: Any) -> dict[str, Any]:
    return {"model": TINY_MODEL_NAME, "input": "Hi", "max_output_tokens": 2} | fields


def embedding(**fields: Any) -> dict[str, Any]:
    return {"model": TINY_MODEL_NAME, "input": "Hi"} | fields


CASES = [
    # authentication
    Case("no API key", CHAT, chat(), 401, code="invalid_api_key", headers={}),
    Case("wrong API key", CHAT, chat(), 401, code="invalid_api_key",
         headers={"Authorization": "Bearer sk-wrong"}),
    Case("API key with another scheme", CHAT, chat(), 401, code="invalid_api_key",
         headers={"Authorization": f"Basic {API_KEY}"}),
    Case("a prefix of the API key", COMPLETIONS, completion(), 401, code="invalid_api_key",
         headers={"Authorization": f"Bearer {API_KEY[:-1]}"}),
    Case("models without a key", "/v1/models", None, 401, method="GET", headers={}),
    Case("tokenize without a key", "/tokenize", {"prompt": "Hi"}, 401, code="invalid_api_key",
         headers={}),
    Case("detokenize with a wrong key", "/detokenize", {"tokens": [5]}, 401,
         code="invalid_api_key", headers={"Authorization": "Bearer sk-wrong"}),
    Case("detokenize an id past the vocabulary", "/detokenize", {"tokens": [49152]},
         param="tokens"),
    # the body itself
    Case("invalid JSON", CHAT, b'{"model": "tiny-llama", "messages": ['),
    Case("empty body", CHAT, b""),
    Case("JSON array instead of object", CHAT, [chat()]),
    Case("JSON NaN", COMPLETIONS, b'{"prompt": "Hi", "max_tokens": NaN}'),
    Case("invalid UTF-8 bytes", COMPLETIONS,
         b'{"prompt": "caf\xc3\x28 \xff\xfe", "max_tokens": 2}'),
    Case("JSON nested 30000 deep", COMPLETIONS, b"[" * 30_000 + b"]" * 30_000),
    Case("oversized body", COMPLETIONS,
         completion(prompt="x" * (MAX_BODY_BYTES + 10)), 413, code="request_too_large"),
    # messages and prompts
    Case("messages missing", CHAT, {"model": TINY_MODEL_NAME}, param="messages",
         code="missing_required_parameter"),
    Case("messages empty", CHAT, chat(messages=[]), param="messages"),
    Case("messages not a list", CHAT, chat(messages="Hi"), param="messages"),
    Case("message not an object", CHAT, chat(messages=["Hi"]), param="messages[0]"),
    Case("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "Hi"}]),
         param="messages[0].role"),
    Case("content a number", CHAT, chat(messages=[{"role": "user", "content": 42}]),
         param="messages[0].content"),
    Case("image content part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]),
         param="messages[0].content[0]"),
    Case("prompt a number", COMPLETIONS, completion(prompt=3.5), param="prompt"),
    Case("prompt token id outside the vocabulary", COMPLETIONS,
         completion(prompt=[1, 10**9]), param="prompt"),
    Case("prompt over the context", COMPLETIONS, completion(prompt=" hello" * 3000),
         code="context_length_exceeded"),
    # valid JSON, not valid Unicode: a lone surrogate (json.dumps writes it as \ud800)
    Case("lone surrogate in the prompt", COMPLETIONS, completion(prompt="\ud800"),
         param="prompt"),
    Case("lone surrogate in chat content", CHAT,
         chat(messages=[{"role": "user", "content": "a\udc80b"}]), param="messages[0].content"),
    Case("lone surrogate in streamed chat content", CHAT,
         chat(messages=[{"role": "user", "content": "\ud800"}], stream=True),
         param="messages[0].content"),
    Case("lone surrogate in a tokenize prompt", "/tokenize", {"prompt": "a\udc80b"},
         param="prompt"),
    Case("lone surrogate in a stop string", COMPLETIONS, completion(stop=["ok", "\ud800"]),
         param="stop[1]"),
    # max_tokens and n
    Case("max_tokens negative", COMPLETIONS, completion(max_tokens=-5), param="max_tokens"),
    Case("max_tokens zero", CHAT, chat(max_tokens=0), param="max_tokens"),
    Case("max_tokens huge", CHAT, chat(max_tokens=10**9), param="max_tokens",
         code="context_length_exceeded"),
    Case("max_tokens a string", COMPLETIONS, completion(max_tokens="10"), param="max_tokens"),
    Case("max_tokens fractional", COMPLETIONS, completion(max_tokens=1.5), param="max_tokens"),
    Case("max_completion_tokens negative", CHAT, chat(max_completion_tokens=-1),
         param="max_completion_tokens"),
    Case("n zero", CHAT, chat(n=0), param="n"),
    Case("n too large", COMPLETIONS, completion(n=100_000), param="n"),
    Case("n a boolean", COMPLETIONS, completion(n=True), param="n"),
    # sampling and other options
    Case("temperature negative", CHAT, chat(temperature=-1), param="temperature"),
    Case("temperature a string", CHAT, chat(temperature="hot"), param="temperature"),
    Case("top_p zero", COMPLETIONS, completion(top_p=0), param="top_p"),
    Case("top_p above one", COMPLETIONS, completion(top_p=1.5), param="top_p"),
    Case("stop a number", CHAT, chat(stop=5), param="stop"),
    Case("stop a list with a number", COMPLETIONS, completion(stop=["a", 1]), param="stop"),
    Case("stop an empty string", COMPLETIONS, completion(stop=""), param="stop"),
    Case("stream a string", CHAT, chat(stream="yes"), param="stream"),
    Case("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}),
         param="stream_options"),
    Case("seed a string", COMPLETIONS, completion(seed="abc"), param="seed"),
    Case("logit_bias key not a token", COMPLETIONS, completion(logit_bias={"abc": 1}),
         param="logit_bias"),
    Case("stop_token_ids outside the vocabulary", CHAT, chat(stop_token_ids=[-1]),
         param="stop_token_ids"),
    Case("completion logprobs too many", COMPLETIONS, completion(logprobs=50),
         param="logprobs"),
    Case("top_logprobs without logprobs", CHAT, chat(top_logprobs=3), param="top_logprobs"),
    # /v1/responses
    Case("responses input missing", RESPONSES, {"model": TINY_MODEL_NAME}, param="input"),
    Case("responses input a number", RESPONSES, response(input=5), param="input"),
    Case("responses input empty", RESPONSES, response(input=[]), param="input"),
    Case("responses item not an object", RESPONSES, response(input=["Hi"]),
         param="input[0]"),
    Case("responses unknown role", RESPONSES, response(input=[{"role": "wizard",
                                                               "content": "Hi"}]),
         param="input[0].role"),
    Case("responses image part", RESPONSES, response(input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://127.0.0.1/x.png"}]}]),
         param="input[0].content[0]"),
    Case("responses unknown item type", RESPONSES, response(input=[{"type": "web_search_call"}]),
         param="input[0].type"),
    Case("function_call without call_id", RESPONSES, response(input=[
        {"type": "function_call", "name": "f", "arguments": "{}"}]),
         param="input[0].call_id"),
    Case("function_call_output without output", RESPONSES, response(input=[
        {"type": "function_call_output", "call_id": "c1"}]), param="input[0].output"),
    Case("responses instructions a list", RESPONSES, response(instructions=["be brief"]),
         param="instructions"),
    Case("max_output_tokens zero", RESPONSES, response(max_output_tokens=0),
         param="max_output_tokens"),
    Case("max_output_tokens past the context", RESPONSES, response(max_output_tokens=10**9),
         code="context_length_exceeded"),
    Case("responses temperature negative", RESPONSES, response(temperature=-1),
         param="temperature"),
    Case("responses web search tool", RESPONSES, response(tools=[{"type": "web_search"}]),
         param="tools[0].type"),
    Case("responses tool_choice naming no tool", RESPONSES, response(
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "g"}), param="tool_choice"),
    Case("responses text.format a string", RESPONSES, response(text={"format": "json"}),
         param="text"),
    Case("responses json_schema without a name", RESPONSES, response(
        text={"format": {"type": "json_schema", "schema": {"type": "object"}}}),
         param="response_format.json_schema.name"),
    Case("responses store a string", RESPONSES, response(store="yes"), param="store"),
    Case("responses background", RESPONSES, response(background=True), param="background"),
    Case("unknown previous_response_id", RESPONSES,
         response(previous_response_id="resp_nope"), 404),
    Case("GET an unknown response", RESPONSES + "/resp_nope", None, 404, method="GET"),
    Case("DELETE an unknown response", RESPONSES + "/resp_nope", None, 404, method="DELETE"),
    # /v1/embeddings
    Case("embeddings input missing", EMBEDDINGS, {"model": TINY_MODEL_NAME}, param="input"),
    Case("embeddings input a number", EMBEDDINGS, embedding(input=5), param="input"),
    Case("embeddings input empty", EMBEDDINGS, embedding(input=[]), param="input"),
    Case("embeddings input an empty string", EMBEDDINGS, embedding(input=["a", ""]),
         param="input"),
    Case("embeddings mixed input", EMBEDDINGS, embedding(input=["a", 5]), param="input"),
    Case("embeddings token id outside the vocabulary", EMBEDDINGS,
         embedding(input=[1, 10**9]), param="input"),
    Case("embeddings empty token list", EMBEDDINGS, embedding(input=[[]]), param="input"),
    Case("embeddings input over the context", EMBEDDINGS, embedding(input=" hello" * 3000),
         param="input", code="context_length_exceeded"),
    Case("embeddings lone surrogate", EMBEDDINGS, embedding(input="a\udc80b"), param="input"),
    Case("embeddings encoding_format unknown", EMBEDDINGS,
         embedding(encoding_format="int8"), param="encoding_format"),
    Case("embeddings encoding_format a number", EMBEDDINGS, embedding(encoding_format=3),
         param="encoding_format"),
    Case("embeddings dimensions", EMBEDDINGS, embedding(dimensions=8), param="dimensions"),
    Case("embeddings too many inputs", EMBEDDINGS, embedding(input=["a"] * 2049),
         param="input"),
    Case("embeddings unknown model", EMBEDDINGS, embedding(model="text-embedding-3-small"), 404,
         param="model", code="model_not_found"),
    Case("embeddings model a number", EMBEDDINGS, embedding(model=3), param="model"),
    Case("embeddings wrong key", EMBEDDINGS, embedding(), 401, code="invalid_api_key",
         headers={"Authorization": "Bearer sk-wrong"}),
    # routing
    Case("unknown model", CHAT, chat(model="gpt-17"), 404, param="model",
         code="model_not_found"),
    Case("unknown route", "/v1/engines", completion(), 404),
    Case("GET on a POST route", COMPLETIONS, None, 405, method="GET"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    launched = tiny_server(shared_tiny_model(tmp_path_factory), "--num-kv-blocks", "512",
                           "--api-key", API_KEY, "--max-body-bytes", str(MAX_BODY_BYTES))
    launched.start(tmp_path_factory.mktemp("logs"))
    yield launched
    assert launched.stop() == 0, launched.log
    assert "Traceback" not in launched.log


def send(server: LaunchedServer, method: str, path: str, body: Any,
         headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        sent_headers = {"Content-Type": "application/json"} | headers
        connection.request(method, path, body=raw, headers=sent_headers)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def assert_serves_normally(server: LaunchedServer) -> None:
    status, _, raw = send(server, "POST", COMPLETIONS, completion(max_tokens=1), AUTH)
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["finish_reason"] == "length"


def test_the_catalogue_is_large_enough() -> None:
    assert len(CASES) >= 30
    for path in (RESPONSES, EMBEDDINGS):
        assert sum(case.path == path for case in CASES) >= 15
    assert len(ANTHROPIC_CASES) >= 15
    assert len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input_gets_an_openai_error(server: LaunchedServer, case: Case) -> None:
    status, headers, raw = send(server, case.method, case.path, case.body, case.headers)
    assert status == case.status, raw[:500]
    assert headers.get("Content-Type", "").startswith("application/json")
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    if case.param is not None:
        assert error["param"] == case.param
    if case.code is not None:
        assert error["code"] == case.code
    if status == 401:
        assert headers.get("WWW-Authenticate") == "Bearer"
    assert_serves_normally(server)


SURROGATE_SWEEP = {
    CHAT: chat(messages=[{"role": "system", "content": "Be brief.", "name": "rules"},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
               stop=["a", "b"], user="someone", stream=True),
    COMPLETIONS: completion(prompt=["Hi", "Ho"], stop="a", suffix="x", user="someone",
                            stream=True),
    "/tokenize": {"model": TINY_MODEL_NAME, "messages": USER},
}


def string_fields(value: Any, path: str = "") -> Iterator[tuple[str, list[Any], Any]]:
    """(path, container, key) of every string in a JSON body."""
    items = enumerate(value) if isinstance(value, list) else value.items()
    for key, item in items:
        here = f"{path}[{key}]" if isinstance(value, list) else (
            f"{path}.{key}" if path else key)
        if isinstance(item, str):
            yield here, value, key
        elif isinstance(item, list | dict):
            yield from string_fields(item, here)


@pytest.mark.parametrize("path", list(SURROGATE_SWEEP))
def test_a_lone_surrogate_in_any_string_field_is_a_400(server: LaunchedServer,
                                                       path: str) -> None:
    template = SURROGATE_SWEEP[path]
    names = [name for name, _, _ in string_fields(template)]
    assert len(names) >= 3
    for name in names:
        body = json.loads(json.dumps(template))
        _, container, key = next(found for found in string_fields(body) if found[0] == name)
        container[key] = "x\ud800y"
        status, _, raw = send(server, "POST", path, body, AUTH)
        assert status == 400, (name, raw[:300])
        assert json.loads(raw)["error"]["param"] == name
    assert_serves_normally(server)


def test_health_and_metrics_need_no_key(server: LaunchedServer) -> None:
    assert send(server, "GET", "/health", None, {})[0] == 200
    status, headers, raw = send(server, "GET", "/metrics", None, {})
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert b"loom:num_requests_running" in raw


MESSAGES = "/v1/messages"
X_KEY = {"x-api-key": API_KEY}


def message(**fields: Any) -> dict[str, Any]:
    return {"model": TINY_MODEL_NAME, "messages": USER, "max_tokens": 2} | fields


WEATHER_TOOL = {"name": "get_weather", "input_schema": {"type": "object"}}
ANTHROPIC_CASES = [
    Case("no key", MESSAGES, message(), 401, headers={}),
    Case("wrong x-api-key", MESSAGES, message(), 401, headers={"x-api-key": "sk-wrong"}),
    Case("invalid JSON", MESSAGES, b'{"model": "tiny-llama", "messages": [', headers=X_KEY),
    Case("max_tokens missing", MESSAGES, {"model": TINY_MODEL_NAME, "messages": USER},
         headers=X_KEY),
    Case("max_tokens zero", MESSAGES, message(max_tokens=0), headers=X_KEY),
    Case("max_tokens past the context", MESSAGES, message(max_tokens=10**9), headers=X_KEY),
    Case("model missing", MESSAGES, {"messages": USER, "max_tokens": 2}, headers=X_KEY),
    Case("unknown model", MESSAGES, message(model="claude-17"), 404, headers=X_KEY),
    Case("messages empty", MESSAGES, message(messages=[]), headers=X_KEY),
    Case("system role in messages", MESSAGES,
         message(messages=[{"role": "system", "content": "Hi"}]), headers=X_KEY),
    Case("image block", MESSAGES, message(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/x.png"}}]}]),
         headers=X_KEY),
    Case("tool_use in a user turn", MESSAGES, message(messages=[{"role": "user", "content": [
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]}]),
         headers=X_KEY),
    Case("tool_result without its id", MESSAGES, message(messages=[
        {"role": "user", "content": [{"type": "tool_result", "content": "sunny"}]}]),
         headers=X_KEY),
    Case("last turn the assistant's", MESSAGES, message(messages=[
        *USER, {"role": "assistant", "content": "Hel"}]), headers=X_KEY),
    Case("temperature above one", MESSAGES, message(temperature=1.5), headers=X_KEY),
    Case("top_k negative", MESSAGES, message(top_k=-3), headers=X_KEY),
    Case("stop_sequences a string", MESSAGES, message(stop_sequences="END"), headers=X_KEY),
    Case("tool without input_schema", MESSAGES, message(tools=[{"name": "get_weather"}]),
         headers=X_KEY),
    Case("tool_choice naming no tool", MESSAGES,
         message(tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "nope"}),
         headers=X_KEY),
    Case("tool_choice of an unknown type", MESSAGES,
         message(tools=[WEATHER_TOOL], tool_choice={"type": "sometimes"}), headers=X_KEY),
    Case("tool_choice without tools", MESSAGES, message(tool_choice={"type": "any"}),
         headers=X_KEY),
    Case("stream a string", MESSAGES, message(stream="yes"), headers=X_KEY),
    Case("count_tokens without messages", MESSAGES + "/count_tokens",
         {"model": TINY_MODEL_NAME}, headers=X_KEY),
    Case("oversized body", MESSAGES, message(system="x" * (MAX_BODY_BYTES + 10)), 413,
         headers=X_KEY),
]
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   404: "not_found_error", 413: "request_too_large"}


@pytest.mark.parametrize("case", ANTHROPIC_CASES, ids=[case.name for case in ANTHROPIC_CASES])
def test_bad_input_to_messages_gets_an_anthropic_error(server: LaunchedServer,
                                                       case: Case) -> None:
    status, headers, raw = send(server, case.method, case.path, case.body, case.headers)
    assert status == case.status, raw[:500]
    assert headers.get("Content-Type", "").startswith("application/json")
    body = json.loads(raw)
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == ANTHROPIC_TYPES[status]
    assert body["error"]["message"]
    status, _, raw = send(server, "POST", MESSAGES, message(), X_KEY)
    assert status == 200, raw
    assert json.loads(raw)["stop_reason"] == "max_tokens"
