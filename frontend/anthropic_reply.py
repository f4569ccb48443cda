"""Anthropic Messages replies: the whole message, or its stream of events (`message_start`,
then per content block `content_block_start`, `content_block_delta` (`text_delta` or
`input_json_delta`), `content_block_stop`, then `message_delta` with the stop reason and the
output tokens, and `message_stop`).

Tool calls are read out of the reply by the chat path's parsers (frontend.tool_parsers): a
call's first delta opens a `tool_use` block, its argument fragments stream as
`input_json_delta`s, and the text around calls is a `text` block.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from frontend.generation import Delta, Usage
from frontend.tool_parsers import CallDelta, Parser, ToolCall, make_parser, parse_reply

Event = tuple[str, dict[str, Any]]


def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def stop_reason(delta: Delta, called: bool) -> str:
    if delta.finish_reason == "length":
        return "max_tokens"
    if delta.stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if called else "end_turn"


def usage_of(usage: Usage) -> dict[str, int]:
    return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens}


@dataclass(slots=True)
class MessageReply:
    model: str
    tool_parser: str | None  # set when the reply may hold tool calls
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex[:24]}")
    _parser: Parser | None = None
    _open: str | None = None  # the kind of the content block open now
    _index: int = -1  # the open (or last) block's index
    _called: bool = False

    def body(self, result: Delta, usage: Usage) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        text, calls = result.text, []
        if self.tool_parser is not None:
            piece = parse_reply(self.tool_parser, result.text, result.finish_reason == "length")
            text, calls = piece.content, piece.calls
        if text or not calls:
            content.append({"type": "text", "text": text})
        content += [{"type": "tool_use", "id": tool_use_id(call), "name": call.name,
                     "input": json.loads(call.arguments)} for call in calls]
        return self._message(content, stop_reason(result, bool(calls)), result.stop_sequence,
                             usage_of(usage))

    def _message(self, content: list[dict[str, Any]], reason: str | None,
                 stop_sequence: str | None, usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "model": self.model, "content": content, "stop_reason": reason,
                "stop_sequence": stop_sequence, "usage": usage}

    def start_events(self, usage: Usage) -> list[Event]:
        message = self._message([], None, None, usage_of(usage) | {"output_tokens": 0})
        return [("message_start", {"type": "message_start", "message": message})]

    def delta_events(self, delta: Delta) -> list[Event]:
        """The events one text delta makes; the last delta's also close the message."""
        events: list[Event] = []
        if self.tool_parser is None:
            if delta.text:
                events += self._text(delta.text)
        else:
            if self._parser is None:
                self._parser = make_parser(self.tool_parser)
            piece = self._parser.feed(delta.text)
            if delta.finish_reason is not None:
                piece.extend(self._parser.finish(cut_short=delta.finish_reason == "length"))
            if piece.content:
                events += self._text(piece.content)
            for call_delta in piece.deltas:
                events += self._call(call_delta)
        return events

    def finish_events(self, last: Delta, usage: Usage) -> list[Event]:
        events = self._close()
        if self._index < 0:  # an empty reply still has its (empty) text block
            events += self._text("") + self._close()
        delta = {"stop_reason": stop_reason(last, self._called),
                 "stop_sequence": last.stop_sequence}
        output = {"output_tokens": usage.completion_tokens}
        return [*events,
                ("message_delta", {"type": "message_delta", "delta": delta, "usage": output}),
                ("message_stop", {"type": "message_stop"})]

    def _text(self, text: str) -> list[Event]:
        events = [] if self._open == "text" else self._open_block(
            {"type": "text", "text": ""})
        if text:
            events.append(self._block_delta({"type": "text_delta", "text": text}))
        return events

    def _call(self, call_delta: CallDelta) -> list[Event]:
        events: list[Event] = []
        if call_delta.call is not None:
            self._called = True
            call = call_delta.call
            events += self._open_block({"type": "tool_use", "id": tool_use_id(call),
                                        "name": call.name, "input": {}})
        if call_delta.arguments:
            events.append(self._block_delta({"type": "input_json_delta",
                                             "partial_json": call_delta.arguments}))
        return events

    def _open_block(self, block: dict[str, Any]) -> list[Event]:
        events = self._close()
        self._index += 1
        self._open = block["type"]
        start = {"type": "content_block_start", "index": self._index, "content_block": block}
        return [*events, ("content_block_start", start)]

    def _block_delta(self, delta: dict[str, Any]) -> Event:
        return ("content_block_delta", {"type": "content_block_delta", "index": self._index,
                                        "delta": delta})

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        self._open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self._index})]
