"""Reading tool calls back out of a model's reply (`--tool-call-parser`, vLLM's names).

- `hermes`: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; text
  outside the blocks is the message's content.
- `llama3_json`: the whole reply is `{"name": ..., "parameters": {...}}` (several joined by
  `;`), optionally after `<|python_tag|>`; any other reply is content.

A parser sees one choice's text as it streams (`feed`, then `finish`) and returns the
content to send, the calls completed so far, and the tool-call deltas to stream (OpenAI's
shape: the first of a call carries its index, id and name, the rest argument fragments);
`parse_reply` is the same over a whole reply, so a streamed reply reassembles to the
non-streamed one. Content that is only whitespace around calls is dropped, in both. A block
that does not parse as a call stays content; one cut off before it closes never does.
hermes streams a call's arguments as they come once its block opens with `{"name": ...,
"arguments": ` (the layout the tool prompt and grammar ask for), holding back the braces that
may close it; the arguments are then the raw text the model wrote. A block laid out
otherwise is sent whole when it closes, its arguments re-serialized. (A streamed block that
then fails to parse keeps the call already begun: the one way streamed and whole can differ.)
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


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


@dataclass(frozen=True, slots=True)
class CallDelta:
    """One streamed piece of a tool call: its first piece names it."""

    index: int
    arguments: str
    call: ToolCall | None = None  # on the first piece: the id and name to send

    def to_openai(self) -> dict[str, Any]:
        if self.call is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.call.id, "type": "function",
                "function": {"name": self.call.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ParsedPiece:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)  # completed, whole
    deltas: list[CallDelta] = field(default_factory=list)  # what to stream

    def extend(self, other: ParsedPiece) -> ParsedPiece:
        self.content += other.content
        self.calls += other.calls
        self.deltas += other.deltas
        return self


HERMES_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


@dataclass(slots=True)
class StreamingCall:
    call: ToolCall  # arguments empty: what was sent is `sent`
    arguments_start: int  # in the block's text
    sent: str = ""


def raw_arguments(body: str, call: ToolCall) -> str | None:
    """The arguments as written, when the block (which parsed as `call`) is laid out as
    `{"name": ..., "arguments": {...}}` and holds exactly that; None otherwise."""
    header = HERMES_HEADER.match(body)
    if header is None or json.loads(header.group(1)) != call.name:
        return None
    tail = body[header.end():].rstrip()
    arguments = tail[:-1].rstrip() if tail.endswith("}") else ""
    try:
        same = json.loads(arguments) == json.loads(call.arguments)
    except ValueError:
        return None
    return arguments if same else None


class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False
        self._blank = ""  # whitespace held until content follows it
        self._streaming: StreamingCall | None = None
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
                    piece.deltas += self._stream_arguments()
                    return piece
                body, self._buffer = self._buffer[:end], self._buffer[end + len(self.CLOSE):]
                self._inside = False
                piece.extend(self._close(body))

    def _stream_arguments(self) -> list[CallDelta]:
        """The open block's arguments so far, but for trailing braces and blanks (they may
        close the call) and a partial close marker."""
        deltas = []
        if self._streaming is None:
            header = HERMES_HEADER.match(self._buffer)
            if header is None:
                return deltas
            try:
                name = json.loads(header.group(1))
            except ValueError:
                return deltas
            self._streaming = StreamingCall(ToolCall(name, ""), header.end())
            deltas.append(CallDelta(self.num_calls, "", self._streaming.call))
        streaming = self._streaming
        end = len(self._buffer) - _partial_suffix(self._buffer, self.CLOSE)
        region = self._buffer[streaming.arguments_start:end].strip().rstrip(" \t\r\n}")
        if len(region) > len(streaming.sent) and region.startswith(streaming.sent):
            deltas.append(CallDelta(self.num_calls, region[len(streaming.sent):]))
            streaming.sent = region
        return deltas

    def _close(self, body: str) -> ParsedPiece:
        streaming, self._streaming = self._streaming, None
        parsed = call_from_json(body.strip(), "arguments")
        raw = None if parsed is None else raw_arguments(body, parsed)
        if streaming is not None:  # begun: finish it with the rest of what the model wrote
            arguments = streaming.sent if raw is None else raw
            rest = arguments[len(streaming.sent):] if arguments.startswith(streaming.sent) else ""
            call = ToolCall(streaming.call.name, streaming.sent + rest, streaming.call.id)
            return self._completed(call, [CallDelta(self.num_calls, rest)] if rest else [])
        if parsed is None:
            return ParsedPiece(self._content(self.OPEN + body + self.CLOSE))
        call = parsed if raw is None else ToolCall(parsed.name, raw)
        return self._completed(call, [CallDelta(self.num_calls, call.arguments, call)])

    def _completed(self, call: ToolCall, deltas: list[CallDelta]) -> ParsedPiece:
        self.num_calls += 1
        return ParsedPiece("", [call], deltas)

    def finish(self, cut_short: bool = False) -> ParsedPiece:
        """The text held back, as content; but a block cut off before it closes is a call
        cut short, never content: whole but for its close marker, it is a call; named, it ends
        with the arguments written so far (the finish reason, `length`, says so); not yet
        named, it is dropped, as is the start of an open marker when max_tokens cut the
        reply (`cut_short`)."""
        rest, self._buffer = self._buffer, ""
        if not self._inside:
            return ParsedPiece("" if cut_short else self._content(rest))
        self._inside = False
        body = rest[:len(rest) - _partial_suffix(rest, self.CLOSE)]
        if call_from_json(body.strip(), "arguments") is not None:
            return self._close(body)
        streaming, self._streaming = self._streaming, None
        if streaming is None:
            return ParsedPiece()
        arguments = body[streaming.arguments_start:].strip()
        unsent = arguments[len(streaming.sent):] if arguments.startswith(streaming.sent) else ""
        call = ToolCall(streaming.call.name, streaming.sent + unsent, streaming.call.id)
        return self._completed(call, [CallDelta(self.num_calls, unsent)] if unsent else [])

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
        self._text = ""  # held until `finish`, while the reply may be a call
        self._plain = False  # the reply began otherwise: content, passed straight on
        self.num_calls = 0

    def feed(self, text: str) -> ParsedPiece:
        if self._plain:
            return ParsedPiece(text)
        self._text += text
        head = self._text.lstrip()
        if (not head or head.startswith("{") or self.PYTHON_TAG.startswith(head)
                or head.startswith(self.PYTHON_TAG)):
            return ParsedPiece()
        self._plain = True
        out, self._text = self._text, ""
        return ParsedPiece(out)

    def finish(self, cut_short: bool = False) -> ParsedPiece:
        text, self._text = self._text, ""
        body = text.strip().removeprefix(self.PYTHON_TAG).strip()
        calls = [call_from_json(part, "parameters") for part in _split_calls(body)]
        if body and all(call is not None for call in calls):
            made = [call for call in calls if call is not None]
            deltas = [CallDelta(self.num_calls + i, call.arguments, call)
                      for i, call in enumerate(made)]
            self.num_calls += len(made)
            return ParsedPiece("", made, deltas)
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


def parse_reply(name: str, text: str, cut_short: bool = False) -> ParsedPiece:
    parser = make_parser(name)
    return parser.feed(text).extend(parser.finish(cut_short))
