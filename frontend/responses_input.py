"""OpenAI Responses request bodies (`POST /v1/responses`) rewritten as the chat completions
body they mean, which the chat path then validates, renders and generates: one path behind
both APIs.

- `input`: a string (one user message) or items: messages (`role` user, system, developer or
  assistant; content a string or `input_text` / `output_text` parts), `function_call`
  (`call_id`, `name`, `arguments`) and `function_call_output` (`call_id`, `output`); the
  `reasoning` items an agent hands back are dropped. `instructions` is a system message
  first (not carried over to a continuation, as OpenAI does).
- `previous_response_id`: the stored conversation (its input and output) comes first.
- `tools` (`{"type": "function", name, description, parameters}`), `tool_choice`
  (`auto`, `none`, `required`, `{"type": "function", "name"}`), `parallel_tool_calls`.
- `text.format` (`text`, `json_object`, `json_schema` with `name` and `schema`) becomes
  `response_format`; `max_output_tokens`, `temperature`, `top_p`, `seed`, `stream`.
"""

from __future__ import annotations

from typing import Any

from frontend.errors import invalid_param
from frontend.schemas import text_of_parts

Message = dict[str, Any]  # a chat completions message
PASSED_ON = ("model", "temperature", "top_p", "seed", "stream", "parallel_tool_calls", "user",
             "top_k", "min_p", "repetition_penalty", "stop")
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


def chat_body(body: dict[str, Any], history: list[Message]) -> tuple[dict[str, Any],
                                                                     list[Message]]:
    """(the chat completions body, the conversation without `instructions`: what a stored
    response continues from)."""
    conversation = history + input_messages(body.get("input"))
    messages = conversation
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid_param("instructions", "'instructions' must be a string.")
        messages = [{"role": "system", "content": instructions}, *conversation]
    chat: dict[str, Any] = {key: body[key] for key in PASSED_ON if key in body}
    chat["messages"] = messages
    max_output = body.get("max_output_tokens")
    if max_output is not None:
        if not isinstance(max_output, int) or isinstance(max_output, bool) or max_output < 1:
            raise invalid_param("max_output_tokens",
                                "'max_output_tokens' must be a positive integer.")
        chat["max_tokens"] = max_output
    if body.get("tools") is not None:
        chat["tools"] = [_function_tool(index, tool) for index, tool in
                         enumerate(_list("tools", body["tools"]))]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat, conversation


def input_messages(raw: Any) -> list[Message]:
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise invalid_param("input", "'input' must be a string or a non-empty list of items.")
    messages: list[Message] = []
    for index, item in enumerate(raw):
        param = f"input[{index}]"
        if not isinstance(item, dict):
            raise invalid_param(param, f"'{param}' must be an object.")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(param, item))
        elif kind == "function_call":
            call = _function_call(param, item)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(f"{param}.call_id",
                                                                     item.get("call_id")),
                             "content": text_of_parts(f"{param}.output", item.get("output"),
                                                     TEXT_PARTS)})
        elif kind != "reasoning":
            raise invalid_param(f"{param}.type", f"'{param}.type' {kind!r} is not supported: "
                                "send messages, function_call and function_call_output items.")
    return messages


def _message(param: str, item: dict[str, Any]) -> Message:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise invalid_param(f"{param}.role", f"'{param}.role' must be one of "
                                             f"{list(MESSAGE_ROLES)}.")
    content = text_of_parts(f"{param}.content", item.get("content"), TEXT_PARTS)
    return {"role": role, "content": content}


def _function_call(param: str, item: dict[str, Any]) -> dict[str, Any]:
    return {"id": _string(f"{param}.call_id", item.get("call_id")), "type": "function",
            "function": {"name": _string(f"{param}.name", item.get("name")),
                         "arguments": _string(f"{param}.arguments", item.get("arguments"))}}


def _string(param: str, raw: Any) -> str:
    if not isinstance(raw, str):
        raise invalid_param(param, f"'{param}' must be a string.")
    return raw


def _list(param: str, raw: Any) -> list[Any]:
    if not isinstance(raw, list):
        raise invalid_param(param, f"'{param}' must be a list.")
    return raw


def _function_tool(index: int, raw: Any) -> dict[str, Any]:
    param = f"tools[{index}]"
    if not isinstance(raw, dict) or raw.get("type") != "function":
        kind = raw.get("type") if isinstance(raw, dict) else None
        raise invalid_param(f"{param}.type", f"'{param}': only function tools are supported, "
                                             f"got {kind!r}.")
    function = {key: raw[key] for key in ("name", "description", "parameters") if key in raw}
    return {"type": "function", "function": function}


def _tool_choice(raw: Any) -> Any:
    if isinstance(raw, dict) and raw.get("type") == "function":
        return {"type": "function", "function": {"name": raw.get("name")}}
    return raw


def _response_format(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    fmt = raw.get("format") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or (fmt is not None and not isinstance(fmt, dict)):
        raise invalid_param("text", "'text' must be an object; 'text.format' an object.")
    if fmt is None or fmt.get("type") != "json_schema":
        return fmt
    spec = {key: fmt[key] for key in ("name", "schema", "strict") if key in fmt}
    return {"type": "json_schema", "json_schema": spec}
