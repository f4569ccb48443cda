"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`.

- Parsing: each tool a `{"type": "function", "function": {name, description, parameters}}`;
  `tool_choice` is "none", "auto" (the default with tools), "required" or a named function.
- Prompt: a chat template that takes `tools` gets them; one that does not (SmolLM2's) gets
  them in the system prompt in the Hermes layout that the `hermes` parser reads back
  (`tools_system_prompt`), with earlier calls and tool results rendered the same way
  (frontend.tokenization).
- A grammar (`call_grammar`) holds every reply that may call: "required" and a named function
  are only calls, "auto" any text until a call opens; a call's name is one of the tools' and
  its arguments valid against that tool's `parameters` schema; the reply may end after any
  complete call; a named function, or `parallel_tool_calls: false`, allows one call at most.
- The reply is read back by frontend.tool_parsers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from frontend.errors import invalid_param
from frontend.json_bounds import number_bound_grammar
from frontend.structured_outputs import JSON_LAYOUT, StructuredOutput, build_grammar

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_CHOICES = ("none", "auto", "required")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class FunctionTool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    tools: tuple[FunctionTool, ...]
    choice: str  # "none" | "auto" | "required" | "function" (then `function` names it)
    function: str | None = None
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    @property
    def forces_call(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def allows_several_calls(self) -> bool:
        return self.parallel and self.choice != "function"

    @property
    def callable_tools(self) -> tuple[FunctionTool, ...]:
        if self.choice == "function":
            return tuple(tool for tool in self.tools if tool.name == self.function)
        return self.tools


def parse_tool_request(body: dict[str, Any]) -> ToolRequest | None:
    raw_tools = body.get("tools")
    raw_choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise invalid_param("parallel_tool_calls", "'parallel_tool_calls' must be a boolean.")
    if raw_tools is None:
        if raw_choice not in (None, "none"):
            raise invalid_param("tool_choice", "'tool_choice' needs 'tools'.")
        return None
    if not isinstance(raw_tools, list) or not raw_tools:
        raise invalid_param("tools", "'tools' must be a non-empty list.")
    tools = tuple(_parse_tool(index, raw) for index, raw in enumerate(raw_tools))
    names = [tool.name for tool in tools]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise invalid_param(f"tools[{index}].function.name",
                                f"Two tools are named {name!r}.")
    choice, function = _parse_tool_choice(raw_choice, names)
    return ToolRequest(tools, choice, function, parallel)


def _parse_tool(index: int, raw: Any) -> FunctionTool:
    param = f"tools[{index}]"
    if not isinstance(raw, dict) or raw.get("type") != "function":
        raise invalid_param(f"{param}.type", f"'{param}' must be an object of type 'function'.")
    function = raw.get("function")
    if not isinstance(function, dict):
        raise invalid_param(f"{param}.function", f"'{param}.function' must be an object.")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise invalid_param(f"{param}.function.name",
                            f"'{param}.function.name' must be 1-64 letters, digits, '_' or "
                            f"'-', got {name!r}.")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid_param(f"{param}.function.description",
                            f"'{param}.function.description' must be a string.")
    parameters = function.get("parameters", EMPTY_PARAMETERS)
    if not isinstance(parameters, dict):
        raise invalid_param(f"{param}.function.parameters",
                            f"'{param}.function.parameters' must be a JSON schema object.")
    return FunctionTool(name, description, parameters)


def _parse_tool_choice(raw: Any, names: list[str]) -> tuple[str, str | None]:
    if raw is None:
        return "auto", None
    if isinstance(raw, str):
        if raw not in TOOL_CHOICES:
            raise invalid_param("tool_choice", f"'tool_choice' must be one of "
                                               f"{list(TOOL_CHOICES)} or a named function.")
        return raw, None
    function = raw.get("function") if isinstance(raw, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(name, str):
        raise invalid_param("tool_choice", "'tool_choice' must be a string or "
                                           '{"type": "function", "function": {"name": ...}}.')
    if name not in names:
        raise invalid_param("tool_choice", f"'tool_choice' names {name!r}, which is not in "
                                           f"'tools' ({', '.join(names)}).")
    return "function", name


def call_grammar(request: ToolRequest, parser: str) -> StructuredOutput | None:
    """The grammar a reply follows when it may call tools, in `parser`'s layout (None for
    tool_choice "none"). Forced ("required", a named function): only calls, each tool's
    parameters checked on their own first so that a bad schema is a 400 naming its tool.
    "auto": any text, but once a call begins it must be whole and valid, and only further
    calls may follow it; a tool schema llguidance cannot enforce is then ignored (lenient)
    rather than refused. Either way the reply may end after any complete call, and at most
    one call is written for a named function or with `parallel_tool_calls: false`."""
    if not request.parses_calls:
        return None
    if request.forces_call:
        for index, tool in enumerate(request.tools):
            if tool in request.callable_tools:
                build_grammar(StructuredOutput(f"tools[{index}].function.parameters", "json",
                                               tool.parameters))
    layout = LLAMA3_JSON if parser == "llama3_json" else HERMES
    options = JSON_LAYOUT if request.forces_call else JSON_LAYOUT | {"lenient": True}
    body = {"anyOf": [
        {"type": "object", "properties": {"name": {"const": tool.name},
                                          layout.arguments_key: tool.parameters},
         "required": ["name", layout.arguments_key], "additionalProperties": False}
        for tool in request.callable_tools], "x-guidance": options}
    lark = layout.grammar(f"%json {json.dumps(body)}", request.forces_call,
                          request.allows_several_calls)
    bound = layout.number_bound([tool.parameters for tool in request.callable_tools],
                                request.forces_call)
    return StructuredOutput("tools", "grammar", lark, number_bound=bound,
                            optional=not request.forces_call)


@dataclass(frozen=True, slots=True)
class CallLayout:
    """How a parser's replies hold calls, in Lark: a call is `opening` then `call_rest` (around
    the JSON `body`), calls are joined by `separator`. Under "auto" a reply may say anything
    before `opening` (the first call's opening then ends the free text), or, for a layout
    without one, anything that does not begin like a call."""

    arguments_key: str
    opening: str
    call_rest: str
    separator: str

    def grammar(self, body: str, forced: bool, several: bool) -> str:
        more = f" ({self.separator} call)*" if several else ""
        call = f"{json.dumps(self.opening)} {self.call_rest}" if self.opening else self.call_rest
        if forced:
            start = f"call{more}"
        elif self.opening:
            start = f"TEXT | head {self.call_rest}{more}"
        else:
            start = f"PLAIN | call{more}"
        rules = "" if forced else self.free_text_rules
        return f"start: {start}\ncall: {call}\nbody: {body}\n{rules}"

    def number_bound(self, schemas: list[dict[str, Any]], forced: bool) -> str:
        if forced:
            return number_bound_grammar(schemas)
        start = "TEXT | head JSON_TEXT" if self.opening else "PLAIN | JSON_TEXT"
        return number_bound_grammar(schemas, start, self.free_text_rules)

    @property
    def free_text_rules(self) -> str:
        if not self.opening:
            return "PLAIN: /(?s:.*)/ & ~/(?s:\\s*\\{.*)/\n"
        opening = re.escape(self.opening)
        return (f"TEXT: /(?s:.*)/ & ~/(?s:.*){opening}(?s:.*)/\n"
                f"head[lazy]: /(?s:.*){opening}/\n")


HERMES = CallLayout("arguments", "<tool_call>", r'"\n" body "\n</tool_call>"', r'"\n"')
LLAMA3_JSON = CallLayout("parameters", "", "body", '"; "')


def tools_system_prompt(tools: tuple[FunctionTool, ...]) -> str:
    """The tools for a model whose chat template cannot take them (Hermes layout)."""
    listed = "\n".join(json.dumps(tool.to_openai()) for tool in tools)
    return (
        "You can call functions to answer the user. Their signatures follow, one JSON object "
        f"per line, between <tools> and </tools>:\n<tools>\n{listed}\n</tools>\n"
        "To call a function, reply with a JSON object holding its name and its arguments "
        "between <tool_call> and </tool_call>, one block per call:\n"
        '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n'
        "</tool_call>\nResults come back between <tool_response> and </tool_response>."
    )
