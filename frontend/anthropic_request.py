"""Anthropic Messages request bodies (`POST /v1/messages`, `/v1/messages/count_tokens`) read
into the chat path's own types: the conversation as ChatMessages, the tools as a
ToolRequest, the sampling as GenerationOptions. So a Messages request renders, tokenizes,
constrains and generates exactly as a chat completion does.

- `system`: a string or text blocks; `messages`: user and assistant turns, content a string
  or blocks: `text`, `tool_use` (assistant), `tool_result` (user; its content a string or
  text blocks). A user turn's tool results become tool messages, its text a user message.
- `tools` ({name, description, input_schema}) and `tool_choice` (auto, any, tool, none;
  `disable_parallel_tool_use`) become OpenAI's function tools and choices.
- `max_tokens` is required, as Anthropic requires; `stop_sequences`, `temperature` (0-1),
  `top_p`, `top_k`, `stream`. Unknown fields are ignored; `metadata` is accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from frontend.body_reader import BodyReader
from frontend.errors import invalid_param
from frontend.schemas import ChatMessage, GenerationOptions, text_of_parts
from frontend.tools import ToolRequest, call_grammar, parse_tool_request

CHOICES = {"auto": "auto", "any": "required", "none": "none"}


@dataclass(slots=True)
class MessagesRequest:
    messages: list[ChatMessage]
    options: GenerationOptions
    tools: ToolRequest | None


def parse_messages_request(body: dict[str, Any], tool_call_parser: str) -> MessagesRequest:
    reader = BodyReader(body)
    if not reader.present("max_tokens"):
        raise invalid_param("max_tokens", "max_tokens: Field required")
    max_tokens = reader.integer("max_tokens", None, minimum=1)
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid_param("stop_sequences", "stop_sequences: must be a list of non-empty "
                                              "strings")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid_param("metadata", "metadata: must be an object")
    options = GenerationOptions(
        model=_model(reader), max_tokens=max_tokens, stream=reader.boolean("stream", False),
        stop=list(stops),
        sampling_fields={
            "temperature": reader.number("temperature", 1.0, minimum=0.0, maximum=1.0),
            "top_p": reader.number("top_p", 1.0, minimum=0.0, maximum=1.0,
                                   exclusive_minimum=True),
            "top_k": reader.integer("top_k", 0, minimum=0) or 0,
        },
    )
    messages, tools = parse_conversation(body)
    if tools is not None:
        options.structured = call_grammar(tools, tool_call_parser)
    return MessagesRequest(messages, options, tools)


def parse_conversation(body: dict[str, Any]) -> tuple[list[ChatMessage], ToolRequest | None]:
    """The system prompt, the turns and the tools (for count_tokens too)."""
    messages = _system(body.get("system"))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid_param("messages", "messages: must be a non-empty list")
    for index, turn in enumerate(raw):
        messages.extend(_turn(f"messages.{index}", turn))
    if messages[-1].role == "assistant":
        raise invalid_param("messages", "messages: the last turn must be the user's (this "
                                        "server does not continue a prefilled assistant turn)")
    return messages, _tools(body)


def _model(reader: BodyReader) -> str:
    model = reader.string("model")
    if not model:
        raise invalid_param("model", "model: Field required")
    return model


def _system(raw: Any) -> list[ChatMessage]:
    if raw is None:
        return []
    return [ChatMessage("system", text_of_parts("system", raw))]


def _turn(param: str, raw: Any) -> list[ChatMessage]:
    if not isinstance(raw, dict) or raw.get("role") not in ("user", "assistant"):
        raise invalid_param(f"{param}.role", f"{param}.role: must be 'user' or 'assistant'")
    role, content = raw["role"], raw.get("content")
    if isinstance(content, str):
        return [ChatMessage(role, content)]
    if not isinstance(content, list):
        raise invalid_param(f"{param}.content", f"{param}.content: must be a string or a "
                                                "list of content blocks")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[ChatMessage] = []
    for index, block in enumerate(content):
        where = f"{param}.content.{index}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(where, block))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(where, block))
        else:
            allowed = "text and tool_use" if role == "assistant" else "text and tool_result"
            raise invalid_param(where, f"{where}: a {role} turn takes {allowed} blocks here, "
                                       f"got {kind!r}")
    if role == "assistant":
        return [ChatMessage("assistant", "\n".join(texts), tool_calls=calls or None)]
    return results + ([ChatMessage("user", "\n".join(texts))] if texts or not results else [])


def _tool_use(where: str, block: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise invalid_param(where, f"{where}: a tool_use block needs a string id and name")
    if not isinstance(block.get("input"), dict):
        raise invalid_param(f"{where}.input", f"{where}.input: must be an object")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"])}}


def _tool_result(where: str, block: dict[str, Any]) -> ChatMessage:
    if not isinstance(block.get("tool_use_id"), str):
        raise invalid_param(f"{where}.tool_use_id", f"{where}.tool_use_id: Field required")
    content = text_of_parts(f"{where}.content", block.get("content", ""))
    if block.get("is_error") is True:
        content = f"Error: {content}"
    return ChatMessage("tool", content, tool_call_id=block["tool_use_id"])


def _tools(body: dict[str, Any]) -> ToolRequest | None:
    """Anthropic's tools and tool_choice in OpenAI's shape, checked by the chat path."""
    raw_tools, raw_choice = body.get("tools"), body.get("tool_choice")
    if raw_tools is None:
        if raw_choice is not None:
            raise invalid_param("tool_choice", "tool_choice: needs tools")
        return None
    if not isinstance(raw_tools, list) or not all(isinstance(t, dict) for t in raw_tools):
        raise invalid_param("tools", "tools: must be a list of tool objects")
    functions = [{"type": "function", "function": {
        "name": tool.get("name"), "parameters": tool.get("input_schema"),
        **({"description": tool["description"]} if "description" in tool else {})}}
        for tool in raw_tools]
    for index, tool in enumerate(raw_tools):
        if not isinstance(tool.get("input_schema"), dict):
            raise invalid_param(f"tools.{index}.input_schema",
                                f"tools.{index}.input_schema: Field required (an object)")
    choice: Any = "auto"
    parallel = True
    if raw_choice is not None:
        kind = raw_choice.get("type") if isinstance(raw_choice, dict) else None
        if kind == "tool":
            choice = {"type": "function", "function": {"name": raw_choice.get("name")}}
        elif kind in CHOICES:
            choice = CHOICES[kind]
        else:
            raise invalid_param("tool_choice", "tool_choice: type must be one of 'auto', "
                                               "'any', 'tool' or 'none'")
        parallel = raw_choice.get("disable_parallel_tool_use") is not True
    return parse_tool_request({"tools": functions, "tool_choice": choice,
                               "parallel_tool_calls": parallel})
