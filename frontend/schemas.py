"""Validated OpenAI request bodies for /v1/completions and /v1/chat/completions.

Unknown fields are ignored, as OpenAI does; known fields that Loom cannot honour yet
(n > 1, logprobs, echo, ...) are rejected rather than silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.sampling import SamplingParams
from frontend.body_reader import BodyReader, check_token_id
from frontend.errors import APIError, invalid_param

SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
CHAT_ROLES = {"system", "developer", "user", "assistant"}


@dataclass(slots=True)
class GenerationOptions:
    """Fields shared by both endpoints."""

    model: str | None
    max_tokens: int | None  # None: up to the context limit
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        if self.min_tokens > max_tokens:
            raise invalid_param(
                "min_tokens",
                f"'min_tokens' ({self.min_tokens}) must not exceed max_tokens ({max_tokens}).",
            )
        try:
            return self._build_sampling_params(max_tokens)
        except ValueError as exc:  # a check SamplingParams has and this module lacks
            raise APIError(f"Invalid sampling parameters: {exc}") from exc

    def _build_sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids),
            logit_bias=dict(self.logit_bias),
        )


@dataclass(slots=True)
class CompletionRequest:
    prompt: str | list[int]  # text, or token ids
    options: GenerationOptions


@dataclass(slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(slots=True)
class ChatRequest:
    messages: list[ChatMessage]
    options: GenerationOptions


def parse_completion_request(body: dict[str, Any], vocab_size: int) -> CompletionRequest:
    reader = BodyReader(body)
    _reject_unsupported(reader, echo=True, best_of=True, suffix=True)
    if reader.body.get("logprobs") is not None:
        raise invalid_param("logprobs", "'logprobs' is not supported yet.")
    max_tokens = reader.integer("max_tokens", None, minimum=1)
    options = _parse_options(reader, max_tokens, vocab_size)
    return CompletionRequest(_parse_prompt(body.get("prompt"), vocab_size), options)


def parse_chat_request(body: dict[str, Any], vocab_size: int) -> ChatRequest:
    reader = BodyReader(body)
    _reject_unsupported(reader)
    if reader.boolean("logprobs", False):
        raise invalid_param("logprobs", "'logprobs' is not supported yet.")
    if reader.present("top_logprobs"):
        raise invalid_param("top_logprobs", "'top_logprobs' is not supported yet.")
    if reader.present("max_completion_tokens"):
        max_tokens = reader.integer("max_completion_tokens", None, minimum=1)
    else:
        max_tokens = reader.integer("max_tokens", None, minimum=1)
    options = _parse_options(reader, max_tokens, vocab_size)
    return ChatRequest(_parse_messages(body.get("messages")), options)


def _reject_unsupported(
    reader: BodyReader, echo: bool = False, best_of: bool = False, suffix: bool = False
) -> None:
    if reader.integer("n", 1, minimum=1) != 1:
        raise invalid_param("n", "Only n=1 is supported.")
    if best_of and reader.integer("best_of", 1, minimum=1) != 1:
        raise invalid_param("best_of", "Only best_of=1 is supported.")
    if echo and reader.boolean("echo", False):
        raise invalid_param("echo", "'echo' is not supported yet.")
    if suffix and reader.string("suffix"):
        raise invalid_param("suffix", "'suffix' is not supported.")


def _parse_options(
    reader: BodyReader, max_tokens: int | None, vocab_size: int
) -> GenerationOptions:
    stream = reader.boolean("stream", False)
    return GenerationOptions(
        model=reader.string("model"),
        max_tokens=max_tokens,
        stream=stream,
        include_usage=_parse_stream_options(reader.body.get("stream_options"), stream),
        stop=_parse_stop(reader.body.get("stop")),
        temperature=reader.number("temperature", 1.0, minimum=0.0),
        top_p=reader.number("top_p", 1.0, minimum=0.0, maximum=1.0, exclusive_minimum=True),
        top_k=_parse_top_k(reader),
        min_p=reader.number("min_p", 0.0, minimum=0.0, maximum=1.0),
        repetition_penalty=reader.number(
            "repetition_penalty", 1.0, minimum=0.0, exclusive_minimum=True
        ),
        presence_penalty=reader.number("presence_penalty", 0.0, minimum=-2.0, maximum=2.0),
        frequency_penalty=reader.number("frequency_penalty", 0.0, minimum=-2.0, maximum=2.0),
        seed=reader.integer("seed", None, minimum=SEED_MIN, maximum=SEED_MAX),
        min_tokens=reader.integer("min_tokens", 0, minimum=0) or 0,
        ignore_eos=reader.boolean("ignore_eos", False),
        stop_token_ids=reader.token_id_list("stop_token_ids", vocab_size),
        logit_bias=_parse_logit_bias(reader.body.get("logit_bias"), vocab_size),
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


def _parse_prompt(raw: Any, vocab_size: int) -> str | list[int]:
    if raw is None:
        raise invalid_param("prompt", "'prompt' is required.", code="missing_required_parameter")
    if isinstance(raw, list) and raw and all(isinstance(item, str | list) for item in raw):
        if len(raw) != 1:
            raise invalid_param("prompt", "Only one prompt per request is supported.")
        raw = raw[0]
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise invalid_param(
            "prompt", "'prompt' must be a string, a list of one string, or a list of token ids."
        )
    if not raw:
        raise invalid_param("prompt", "'prompt' must not be empty.")
    return [check_token_id("prompt", item, vocab_size) for item in raw]


def _parse_messages(raw: Any) -> list[ChatMessage]:
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
    return ChatMessage(
        "system" if role == "developer" else role, _parse_content(f"{param}.content", content)
    )


def _parse_content(param: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_param(param, f"'{param}' must be a string or a list of text parts.")
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise invalid_param(
                f"{param}[{index}]", f"'{param}[{index}]': only text parts are supported."
            )
        text = part.get("text")
        if not isinstance(text, str):
            name = f"{param}[{index}].text"
            raise invalid_param(name, f"'{name}' must be a string.")
        texts.append(text)
    return "\n".join(texts)
