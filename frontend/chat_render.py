"""Chat messages (with tool calls and tool results) as the conversation a chat template
renders, and the tools passed to it.

A template that mentions `tools` takes them and the messages in Hugging Face's tool-use
shape (assistant `tool_calls` with arguments as objects, `tool` messages with their
`tool_call_id`). Any other template gets the Hermes layout in plain messages: the tools in
the system prompt, each earlier call as a `<tool_call>` block in the assistant's text, each
result as a user turn in `<tool_response>` tags.
"""

from __future__ import annotations

import json
from typing import Any

from frontend.schemas import ChatMessage
from frontend.tools import ToolRequest, tools_system_prompt

Conversation = list[dict[str, Any]]


def template_takes_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def render_conversation(messages: list[ChatMessage], tools: ToolRequest | None,
                        template: str | None) -> tuple[Conversation, list[dict] | None]:
    """(the conversation, the `tools` argument for the template, or None)."""
    if template_takes_tools(template):
        conversation = [_structured(message) for message in messages]
        return conversation, None if tools is None else [t.to_openai() for t in tools.tools]
    conversation = [_hermes(message) for message in messages]
    if tools is not None:
        prompt = tools_system_prompt(tools.tools)
        if conversation[0]["role"] == "system":
            conversation[0]["content"] += "\n\n" + prompt
        else:
            conversation.insert(0, {"role": "system", "content": prompt})
    return conversation, None


def _structured(message: ChatMessage) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": call["id"], "type": "function",
             "function": {"name": call["function"]["name"],
                          "arguments": json.loads(call["function"]["arguments"])}}
            for call in message.tool_calls]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _hermes(message: ChatMessage) -> dict[str, str]:
    if message.role == "tool":
        return {"role": "user",
                "content": f"<tool_response>\n{message.content}\n</tool_response>"}
    blocks = [
        "<tool_call>\n" + json.dumps({"name": call["function"]["name"],
                                      "arguments": json.loads(call["function"]["arguments"])})
        + "\n</tool_call>"
        for call in message.tool_calls or ()]
    content = "\n".join(part for part in (message.content, *blocks) if part)
    return {"role": message.role, "content": content}
