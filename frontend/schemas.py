"""Validated OpenAI request bodies for /v1/completions and /v1/chat/completions.

Unknown fields are ignored, as OpenAI does; known fields that Loom cannot honour
(`suffix`, `best_of` other than n, echo with logprobs) are rejected rather than silently
ignored.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from common.sampling import SamplingParams
from frontend.body_reader import BodyReader, check_token_id
from frontend.errors import APIError, invalid_param
from frontend.prompt_input import Prompt, parse_prompts
from frontend.structured_outputs import StructuredOutput, structured_output_of
from frontend.tools import ToolRequest, call_grammar, parse_tool_request

SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1  # what the wire's int64 carries
MAX_N = 128
MAX_CHOICES = 1024  # prompts x n in one request
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass(slots=True)
class GenerationOptions:
    """Fields shared by both endpoints."""

    model: str | None
    max_tokens: int | None  # None: up to the context limit
    n: int = 1
    logprobs: int | None = None  # top logprobs per token; None: no logprobs
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    priority: int = 0  # lower runs first, under --scheduling-policy priority
    # Keyword arguments for common.sampling.SamplingParams: every field but max_tokens (known
    # only per prompt, once its length is) and logprobs (above).
    sampling_fields: dict[str, Any] = field(default_factory=dict)
    # The output's constraint; its grammar is built on a thread by the handler (openai_api).
    structured: StructuredOutput | None = None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        min_tokens = self.sampling_fields.get("min_tokens", 0)
        if min_tokens > max_tokens:
            raise invalid_param(
                "min_tokens",
                f"'min_tokens' ({min_tokens}) must not exceed max_tokens ({max_tokens}).",
            )
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs,
                                  **copy.deepcopy(self.sampling_fields))
        except ValueError as exc:  # a check SamplingParams has and this module lacks
            raise APIError(f"Invalid sampling parameters: {exc}") from exc


@dataclass(slots=True)
class CompletionRequest:
    prompts: list[Prompt]  # each one text, or token ids; n choices each
    options: GenerationOptions
    echo: bool = False


@dataclass(slots=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls (validated)
    tool_call_id: str | None = None  # a tool result: the call it answers


@dataclass(slots=True)
class ChatRequest:
    messages: list[ChatMessage]
    options: GenerationOptions
    tools: ToolRequest | None = None


def parse_completion_request(body: dict[str, Any], vocab_size: int) -> CompletionRequest:
    reader = BodyReader(body)
    n = _parse_n(reader)
    best_of = reader.integer("best_of", None, minimum=1)
    if best_of is not None and best_of != n:
        raise invalid_param("best_of", "'best_of' is not supported unless it equals n.")
    if reader.string("suffix"):
        raise invalid_param("suffix", "'suffix' is not supported.")
    echo = reader.boolean("echo", False)
    logprobs = reader.integer("logprobs", None, minimum=0, maximum=MAX_COMPLETION_LOGPROBS)
    if echo and logprobs is not None:
        raise invalid_param(
            "echo",
            "'echo' together with 'logprobs' needs the prompt's logprobs, which this server "
            "does not compute; drop one of the two.",
        )
    max_tokens = reader.integer("max_tokens", None, minimum=1)
    options = _parse_options(reader, max_tokens, vocab_size, n, logprobs)
    prompts = parse_prompts(body.get("prompt"), vocab_size)
    if len(prompts) * n > MAX_CHOICES:
        raise invalid_param(
            "prompt",
            f"A request may produce at most {MAX_CHOICES} choices; {len(prompts)} prompts "
            f"with n={n} make {len(prompts) * n}.",
        )
    return CompletionRequest(prompts, options, echo)


def parse_chat_request(body: dict[str, Any], vocab_size: int,
                       tool_call_parser: str = "hermes") -> ChatRequest:
    reader = BodyReader(body)
    n = _parse_n(reader)
    wants_logprobs = reader.boolean("logprobs", False)
    top_logprobs = reader.integer("top_logprobs", None, minimum=0, maximum=MAX_TOP_LOGPROBS)
    if top_logprobs is not None and not wants_logprobs:
        raise invalid_param("top_logprobs", "'top_logprobs' requires 'logprobs' to be true.")
    logprobs = (top_logprobs or 0) if wants_logprobs else None
    if reader.present("max_completion_tokens"):
        max_tokens = reader.integer("max_completion_tokens", None, minimum=1)
    else:
        max_tokens = reader.integer("max_tokens", None, minimum=1)
    options = _parse_options(reader, max_tokens, vocab_size, n, logprobs)
    tools = parse_tool_request(body)
    if tools is not None and tools.forces_call and options.structured is not None:
        raise invalid_param("tool_choice", f"tool_choice {body.get('tool_choice')!r} "
                                           f"forces a call; drop '{options.structured.param}'.")
    if tools is not None and options.structured is None:  # else it rules the whole reply
        options.structured = call_grammar(tools, tool_call_parser)
    return ChatRequest(parse_messages(body.get("messages")), options, tools)


def _parse_n(reader: BodyReader) -> int:
    n = reader.integer("n", 1, minimum=1, maximum=MAX_N)
    assert n is not None
    return n


def _parse_options(
    reader: BodyReader, max_tokens: int | None, vocab_size: int, n: int, logprobs: int | None
) -> GenerationOptions:
    stream = reader.boolean("stream", False)
    return GenerationOptions(
        model=reader.string("model"),
        max_tokens=max_tokens,
        n=n,
        logprobs=logprobs,
        stream=stream,
        include_usage=_parse_stream_options(reader.body.get("stream_options"), stream),
        stop=_parse_stop(reader.body.get("stop")),
        priority=reader.integer("priority", 0, minimum=PRIORITY_MIN, maximum=PRIORITY_MAX) or 0,
        sampling_fields={
            "temperature": reader.number("temperature", 1.0, minimum=0.0),
            "top_p": reader.number("top_p", 1.0, minimum=0.0, maximum=1.0,
                                   exclusive_minimum=True),
            "top_k": _parse_top_k(reader),
            "min_p": reader.number("min_p", 0.0, minimum=0.0, maximum=1.0),
            "repetition_penalty": reader.number("repetition_penalty", 1.0, minimum=0.0,
                                                exclusive_minimum=True),
            "presence_penalty": reader.number("presence_penalty", 0.0, minimum=-2.0,
                                              maximum=2.0),
            "frequency_penalty": reader.number("frequency_penalty", 0.0, minimum=-2.0,
                                               maximum=2.0),
            "seed": reader.integer("seed", None, minimum=SEED_MIN, maximum=SEED_MAX),
            "min_tokens": reader.integer("min_tokens", 0, minimum=0) or 0,
            "ignore_eos": reader.boolean("ignore_eos", False),
            "stop_token_ids": reader.token_id_list("stop_token_ids", vocab_size),
            "logit_bias": _parse_logit_bias(reader.body.get("logit_bias"), vocab_size),
        },
        structured=structured_output_of(reader.body),
    )


def _parse_top_k(reader: BodyReader) -> int:
    top_k = reader.integer("top_k", 0)
    assert top_k is not None
    if top_k < -1:
        raise invalid_param("top_k", f"'top_k' must be -1, 0 (disabled) or positive, got {top_k}.")
    return top_k


def _parse_stream_options(raw: Any, stream: bool) -> bool:
    if raw is None:
        return False
    if not isinstance(raw, dict):
        raise invalid_param("stream_options", "'stream_options' must be an object.")
    if not stream:
        raise invalid_param("stream_options", "'stream_options' is only allowed with stream=true.")
    include_usage = raw.get("include_usage")
    if include_usage is None:
        return False
    if not isinstance(include_usage, bool):
        raise invalid_param(
            "stream_options.include_usage", "'stream_options.include_usage' must be a boolean."
        )
    return include_usage


def _parse_stop(raw: Any) -> list[str]:
    if raw is None:
        return []
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid_param("stop", "'stop' must be a string or a list of strings.")
    if any(s == "" for s in stops):
        raise invalid_param("stop", "'stop' must not contain empty strings.")
    return stops


def _parse_logit_bias(raw: Any, vocab_size: int) -> dict[int, float]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise invalid_param("logit_bias", "'logit_bias' must map token ids to biases.")
    bias: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise invalid_param(
                "logit_bias", f"'logit_bias' key {key!r} is not a token id."
            ) from None
        token = check_token_id("logit_bias", token, vocab_size)
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        if not is_number or not -100 <= value <= 100:
            raise invalid_param(
                "logit_bias", f"'logit_bias' values must be numbers in [-100, 100], got {value!r}."
            )
        bias[token] = float(value)
    return bias


def parse_messages(raw: Any) -> list[ChatMessage]:
    if raw is None:
        raise invalid_param(
            "messages", "'messages' is required.", code="missing_required_parameter"
        )
    if not isinstance(raw, list) or not raw:
        raise invalid_param("messages", "'messages' must be a non-empty list.")
    return [_parse_message(index, message) for index, message in enumerate(raw)]


def _parse_message(index: int, raw: Any) -> ChatMessage:
    param = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise invalid_param(param, f"'{param}' must be an object.")
    role = raw.get("role")
    if role not in CHAT_ROLES:
        raise invalid_param(
            f"{param}.role",
            f"'{param}.role' must be one of {sorted(CHAT_ROLES)}, got {role!r}.",
        )
    content = raw.get("content")
    if content is None and role == "assistant":
        content = ""
    message = ChatMessage(
        "system" if role == "developer" else role, text_of_parts(f"{param}.content", content)
    )
    if role == "tool":
        message.tool_call_id = raw.get("tool_call_id")
        if not isinstance(message.tool_call_id, str):
            raise invalid_param(f"{param}.tool_call_id",
                                f"'{param}.tool_call_id' is required for a tool message.")
    if role == "assistant" and raw.get("tool_calls") is not None:
        message.tool_calls = _parse_tool_calls(f"{param}.tool_calls", raw["tool_calls"])
    return message


def _parse_tool_calls(param: str, raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise invalid_param(param, f"'{param}' must be a list.")
    for index, call in enumerate(raw):
        where = f"{param}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid_param(where, f"'{where}' must be a function call with a name.")
        if not isinstance(call.get("id"), str):
            raise invalid_param(f"{where}.id", f"'{where}.id' must be a string.")
        try:
            arguments = json.loads(function.get("arguments"))
        except (TypeError, ValueError):
            arguments = None
        if not isinstance(arguments, dict):
            raise invalid_param(f"{where}.function.arguments",
                                f"'{where}.function.arguments' must be a JSON object string.")
    return raw


def text_of_parts(param: str, content: Any, part_types: tuple[str, ...] = ("text",)) -> str:
    """A message's content: a string, or text parts (of `part_types`) joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_param(param, f"'{param}' must be a string or a list of text parts.")
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in part_types:
            raise invalid_param(
                f"{param}[{index}]", f"'{param}[{index}]': only text parts are supported."
            )
        text = part.get("text")
        if not isinstance(text, str):
            name = f"{param}[{index}].text"
            raise invalid_param(name, f"'{name}' must be a string.")
        texts.append(text)
    return "\n".join(texts)
