"""Reading tool calls back out of a model's reply (`--tool-call-parser`, vLLM's names).

- `hermes`: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; text
  outside the blocks is the message's content.
- `llama3_json`: the whole reply is `{"name": ..., "parameters": {...}}` (several joined by
  `;`), optionally after `<|python_tag|>`; any other reply is content.

A parser sees one choice's text as it streams (`feed`, then `finish`) and returns the
content to send and the calls completed so far; `parse` is the same over a whole reply, so a
streamed reply reassembles to the non-streamed one. Content that is only whitespace around
calls is dropped, in both. A block that does not parse as a call stays content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def call_from_json(text: str, arguments_key: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


@dataclass(slots=True)
class ParsedPiece:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False
        self._blank = ""  # whitespace held until content follows it
        self.num_calls = 0

    def feed(self, text: str) -> ParsedPiece:
        self._buffer += text
        piece = ParsedPiece()
        while True:
            if not self._inside:
                start = self._buffer.find(self.OPEN)
                if start < 0:
                    safe = len(self._buffer) - _partial_suffix(self._buffer, self.OPEN)
                    piece.content += self._content(self._buffer[:safe])
                    self._buffer = self._buffer[safe:]
                    return piece
                piece.content += self._content(self._buffer[:start])
                self._buffer = self._buffer[start + len(self.OPEN):]
                self._inside = True
            else:
                end = self._buffer.find(self.CLOSE)
                if end < 0:
                    return piece
                body, self._buffer = self._buffer[:end], self._buffer[end + len(self.CLOSE):]
                self._inside = False
                call = call_from_json(body.strip(), "arguments")
                if call is None:
                    piece.content += self._content(self.OPEN + body + self.CLOSE)
                else:
                    piece.calls.append(call)
                    self.num_calls += 1

    def finish(self) -> ParsedPiece:
        rest = (self.OPEN if self._inside else "") + self._buffer
        self._buffer, self._inside = "", False
        return ParsedPiece(self._content(rest))

    def _content(self, text: str) -> str:
        if not text.strip():
            self._blank += text
            return ""
        out, self._blank = self._blank + text, ""
        stripped = out.rstrip()
        self._blank = out[len(stripped):]
        return stripped


class Llama3JsonParser:
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._text = ""
        self._decided: bool | None = None  # True: a call, False: plain content
        self.num_calls = 0

    def feed(self, text: str) -> ParsedPiece:
        if self._decided is False:
            return ParsedPiece(text)
        self._text += text
        head = self._text.lstrip()
        if not head or self.PYTHON_TAG.startswith(head) or head.startswith(self.PYTHON_TAG):
            return ParsedPiece()
        self._decided = head.startswith("{") or None
        if self._decided is None:
            self._decided = False
            out, self._text = self._text, ""
            return ParsedPiece(out)
        return ParsedPiece()

    def finish(self) -> ParsedPiece:
        text, self._text = self._text, ""
        body = text.strip().removeprefix(self.PYTHON_TAG).strip()
        calls = [call_from_json(part, "parameters") for part in _split_calls(body)]
        if body and all(call is not None for call in calls):
            self.num_calls += len(calls)
            return ParsedPiece("", [call for call in calls if call is not None])
        return ParsedPiece(text)


def _split_calls(body: str) -> list[str]:
    """`{...}; {...}` into its objects (a `;` inside a JSON string stays)."""
    decoder = json.JSONDecoder()
    parts, position = [], 0
    while position < len(body):
        try:
            _, end = decoder.raw_decode(body, position)
        except ValueError:
            return [body]
        parts.append(body[position:end])
        position = end
        while position < len(body) and body[position] in " ;\n":
            position += 1
    return parts


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that `marker` starts with."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


Parser = HermesParser | Llama3JsonParser


def make_parser(name: str) -> Parser:
    return Llama3JsonParser() if name == "llama3_json" else HermesParser()


def parse_reply(name: str, text: str) -> ParsedPiece:
    parser = make_parser(name)
    piece = parser.feed(text)
    rest = parser.finish()
    return ParsedPiece(piece.content + rest.content, piece.calls + rest.calls)
