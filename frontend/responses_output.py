"""OpenAI Responses replies: the response object, or its stream of semantic events
(`response.created`, `response.in_progress`, per output item `response.output_item.added`,
then for a message `response.content_part.added`, `response.output_text.delta`s,
`response.output_text.done`, `response.content_part.done`, for a function call
`response.function_call_arguments.delta`s and `…done`, then `response.output_item.done`;
last `response.completed`, or `response.incomplete` when max_output_tokens cut it).

Tool calls are read out of the reply by the chat path's parsers (frontend.tool_parsers).
"""

from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from frontend.generation import Delta, Usage
from frontend.tool_parsers import CallDelta, Parser, ToolCall, make_parser, parse_reply

Event = tuple[str, dict[str, Any]]
Item = dict[str, Any]
ECHOED = ("instructions", "max_output_tokens", "metadata", "previous_response_id",
          "temperature", "top_p", "text", "user")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_of(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: ToolCall, arguments: str, status: str = "completed") -> Item:
    return {"id": new_id("fc"), "type": "function_call", "status": status,
            "call_id": call.id, "name": call.name, "arguments": arguments}


@dataclass(slots=True)
class ResponseReply:
    body: dict[str, Any]  # the request, for the fields a response echoes
    model: str
    tool_parser: str | None  # set when the reply may hold tool calls
    response_id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[Item] = field(default_factory=list)
    status: str = "in_progress"  # until the reply is whole
    _parser: Parser | None = None
    _open: Item | None = None  # the output item being streamed
    _sequence: int = 0

    def response(self, status: str, usage: Usage | None) -> dict[str, Any]:
        body = self.body
        tools = [tool for tool in body.get("tools") or [] if isinstance(tool, dict)]
        response = {key: body.get(key) for key in ECHOED} | {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": self.output, "error": None,
            "incomplete_details": None, "tools": tools,
            "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "store": body.get("store", True),
            "usage": None if usage is None else usage_of(usage)}
        response["metadata"] = response["metadata"] or {}
        if status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        return response

    def finished(self, result: Delta, usage: Usage) -> dict[str, Any]:
        """The whole response, for a reply that was not streamed."""
        text, calls = result.text, []
        if self.tool_parser is not None:
            piece = parse_reply(self.tool_parser, result.text, result.finish_reason == "length")
            text, calls = piece.content, piece.calls
        if text or not calls:
            self.output.append(self._message_item([text_part(text)], "completed"))
        self.output += [call_item(call, call.arguments) for call in calls]
        self.status = _status(result)
        return self.response(self.status, usage)

    def assistant_message(self) -> dict[str, Any]:
        """The output as a chat completions message, for a conversation that continues."""
        text = "".join(part["text"] for item in self.output if item["type"] == "message"
                       for part in item["content"])
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in self.output if item["type"] == "function_call"]
        return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}

    def start_events(self, usage: Usage) -> list[Event]:
        response = self.response("in_progress", None)
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def delta_events(self, delta: Delta) -> list[Event]:
        if self.tool_parser is None:
            return self._text(delta.text) if delta.text else []
        if self._parser is None:
            self._parser = make_parser(self.tool_parser)
        piece = self._parser.feed(delta.text)
        if delta.finish_reason is not None:
            piece.extend(self._parser.finish(cut_short=delta.finish_reason == "length"))
        events = self._text(piece.content) if piece.content else []
        for call_delta in piece.deltas:
            events += self._call(call_delta)
        return events

    def finish_events(self, last: Delta, usage: Usage) -> list[Event]:
        events = self._close()
        if not self.output:  # an empty reply is still one (empty) message
            events += self._text("") + self._close()
        self.status = _status(last)
        name = f"response.{self.status}"
        return [*events, self._event(name, response=self.response(self.status, usage))]

    def _message_item(self, content: list[dict[str, Any]], status: str) -> Item:
        return {"id": new_id("msg"), "type": "message", "status": status,
                "role": "assistant", "content": content}

    def _text(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open["type"] != "message":
            events += self._open_item(self._message_item([], "in_progress"))
            events.append(self._item_event("response.content_part.added", content_index=0,
                                           part=text_part("")))
            self._open["content"].append(text_part(""))
        if text:
            self._open["content"][0]["text"] += text
            events.append(self._item_event("response.output_text.delta", content_index=0,
                                           delta=text, logprobs=[]))
        return events

    def _call(self, call_delta: CallDelta) -> list[Event]:
        events: list[Event] = []
        if call_delta.call is not None:
            events += self._open_item(call_item(call_delta.call, "", "in_progress"))
        if call_delta.arguments and self._open is not None:
            self._open["arguments"] += call_delta.arguments
            events.append(self._item_event("response.function_call_arguments.delta",
                                           delta=call_delta.arguments))
        return events

    def _open_item(self, item: Item) -> list[Event]:
        events = self._close()
        self.output.append(item)
        self._open = item
        return [*events, self._event("response.output_item.added",
                                     output_index=len(self.output) - 1, item=item)]

    def _close(self) -> list[Event]:
        item = self._open
        if item is None:
            return []
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [self._item_event("response.output_text.done", content_index=0,
                                        text=part["text"], logprobs=[]),
                       self._item_event("response.content_part.done", content_index=0,
                                        part=part)]
        else:
            events.append(self._item_event("response.function_call_arguments.done",
                                           arguments=item["arguments"], name=item["name"]))
        item["status"] = "completed"
        events.append(self._event("response.output_item.done",
                                  output_index=len(self.output) - 1, item=item))
        self._open = None
        return events

    def _item_event(self, kind: str, **fields: Any) -> Event:
        assert self._open is not None
        return self._event(kind, item_id=self._open["id"], output_index=len(self.output) - 1,
                           **fields)

    def _event(self, kind: str, **fields: Any) -> Event:
        """`kind` names the event (its `type`); fields may include a `name` (a function's)."""
        self._sequence += 1
        return kind, {"type": kind, "sequence_number": self._sequence - 1, **_copy(fields)}


def _copy(fields: dict[str, Any]) -> dict[str, Any]:
    """Events carry items as they stood when sent (later deltas change the live ones)."""
    return copy.deepcopy(fields)


def _status(last: Delta) -> str:
    return "incomplete" if last.finish_reason == "length" else "completed"
