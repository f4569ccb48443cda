"""Structured outputs: a request's `response_format` or `structured_outputs` as one grammar.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`) and vLLM's extra body
`structured_outputs` (`json`, `regex`, `choice`, `grammar`; also its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` fields) become one llguidance grammar
(a string), validated here so that a bad schema, regex or grammar is a 400 naming what is
wrong before anything reaches the engine. llguidance fails closed: a JSON-schema keyword it
cannot enforce (`uniqueItems`, `contains`, ...) is an error, never an unconstrained answer.
Parsing the request is cheap and done with the rest of the body; building the grammar can
take a second for a large one, so the handler runs `build_grammars` on a thread (llguidance
drops the GIL) and the event loop keeps streaming. A JSON output also gets a grammar that
bounds its numbers (frontend.json_bounds). The engine compiles the grammars against its
tokenizer and masks every sampled token by all of them.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from typing import Any

from common.protocol import MAX_STRING_BYTES
from frontend.errors import APIError, invalid_param
from frontend.json_bounds import number_bound_grammar

logger = logging.getLogger("loom.frontend.structured")

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")
GUIDED_FIELDS = {f"guided_{kind}": kind for kind in STRUCTURED_KINDS}
ANY_JSON_OBJECT = {"type": "object"}
# JSON is written as json.dumps writes it, with no free whitespace: a small model given the
# choice loops on blanks until max_tokens. A schema's "x-guidance" options override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    param: str  # the request field it came from, named in errors
    kind: str  # one of STRUCTURED_KINDS
    spec: Any  # a JSON schema, regex, choice list or grammar text
    number_bound: str | None = None  # a grammar holding the JSON in a "grammar" to bounded
    # numbers (tool calls); a "json" kind gets its own from its schema
    optional: bool = False  # if it cannot be built, the output goes unconstrained (no 400)


def structured_output_of(body: dict[str, Any]) -> StructuredOutput | None:
    """What the request constrains its output to, or None when it does not."""
    from_format = _from_response_format(body.get("response_format"))
    from_extra = _from_structured_outputs(body)
    if from_format is not None and from_extra is not None:
        raise invalid_param(
            "response_format",
            "'response_format' and 'structured_outputs' both constrain the output; "
            "send only one of them.",
        )
    return from_format or from_extra


def _from_response_format(raw: Any) -> StructuredOutput | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise invalid_param("response_format",
                            "'response_format' must be an object with a string 'type'.")
    kind = raw["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("response_format", "json", ANY_JSON_OBJECT)
    if kind == "json_schema":
        spec = raw.get("json_schema")
        param = "response_format.json_schema"
        if not isinstance(spec, dict):
            raise invalid_param(param, "'json_schema' must be an object with 'name' and "
                                       "'schema'.")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise invalid_param(f"{param}.name", "'json_schema.name' must be a non-empty "
                                                 "string.")
        schema = spec.get("schema", ANY_JSON_OBJECT)
        if not isinstance(schema, dict):
            raise invalid_param(f"{param}.schema", "'json_schema.schema' must be an object.")
        return StructuredOutput(f"{param}.schema", "json", schema)
    raise invalid_param("response_format.type",
                        f"'response_format.type' must be 'text', 'json_object' or "
                        f"'json_schema', not {kind!r}.")


def _from_structured_outputs(body: dict[str, Any]) -> StructuredOutput | None:
    found: list[StructuredOutput] = []
    raw = body.get("structured_outputs")
    if raw is not None:
        if not isinstance(raw, dict):
            raise invalid_param("structured_outputs", "'structured_outputs' must be an object.")
        found += [StructuredOutput(f"structured_outputs.{kind}", kind, raw[kind])
                  for kind in STRUCTURED_KINDS if raw.get(kind) is not None]
        unknown = sorted(set(raw) - set(STRUCTURED_KINDS))
        if unknown:
            raise invalid_param("structured_outputs",
                                f"'structured_outputs' takes one of {list(STRUCTURED_KINDS)}; "
                                f"unknown: {unknown}.")
    found += [StructuredOutput(name, kind, body[name]) for name, kind in GUIDED_FIELDS.items()
              if body.get(name) is not None]
    if len(found) > 1:
        raise invalid_param(found[1].param, f"Only one structured output may be asked for; "
                                            f"got {', '.join(f.param for f in found)}.")
    return found[0] if found else None


def build_grammars(structured: StructuredOutput) -> list[str]:
    """The grammars the output must match: the constraint itself and, where it holds JSON, the
    bound on its numbers (frontend.json_bounds). A 400 naming the field if llguidance refuses
    the constraint; nothing for an optional one it refuses."""
    try:
        grammars = [build_grammar(structured)]
    except APIError as exc:
        if not structured.optional:
            raise
        logger.info("%s left unconstrained: %s", structured.param, exc.message)
        return []
    bound = (number_bound_grammar([structured.spec]) if structured.kind == "json"
             else structured.number_bound)
    if bound is not None:
        error = _bound_error(bound)
        if error:
            raise invalid_param(structured.param, f"Invalid grammar: {error.strip()}")
        grammars.append(bound)
    return grammars


@functools.lru_cache(maxsize=64)
def _bound_error(grammar: str) -> str:
    """llguidance's verdict on a number-bound grammar: one of a few texts, checked once each
    rather than per request."""
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(grammar)


def build_grammar(structured: StructuredOutput) -> str:
    """Builds and validates the grammar; a 400 naming the field if llguidance refuses it."""
    from llguidance import LLMatcher

    param, kind, spec = structured.param, structured.kind, structured.spec
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as exc:
                raise invalid_param(param, f"The JSON schema is not valid JSON: {exc}") from exc
        if not isinstance(spec, dict | bool):
            raise invalid_param(param, "A JSON schema must be an object.")
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(spec), defaults=JSON_LAYOUT)
    elif kind == "choice":
        if (not isinstance(spec, list) or not spec
                or not all(isinstance(choice, str) for choice in spec)):
            raise invalid_param(param, "'choice' must be a non-empty list of strings.")
        grammar = LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(choice) for choice in spec))
    elif kind in ("regex", "grammar"):
        if not isinstance(spec, str) or not spec:
            raise invalid_param(param, f"'{kind}' must be a non-empty string.")
        grammar = (LLMatcher.grammar_from_regex(spec) if kind == "regex"
                   else _grammar_from_ebnf(param, spec))
    else:  # pragma: no cover - the callers pass known kinds only
        raise APIError(f"unknown structured output kind {kind!r}")
    if len(grammar.encode()) > MAX_STRING_BYTES:
        raise invalid_param(param, f"The {_KIND_NAMES[kind]} makes a grammar of more than "
                                   f"{MAX_STRING_BYTES // 2**20} MiB; this server takes no larger.")
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise invalid_param(param, f"Invalid {_KIND_NAMES[kind]}: {error.strip()}")
    return grammar


_KIND_NAMES = {"json": "JSON schema", "regex": "regular expression", "choice": "choice list",
               "grammar": "grammar"}


def _grammar_from_ebnf(param: str, text: str) -> str:
    """A Lark grammar, or a GBNF one (llama.cpp's `root ::= ...`) converted to Lark."""
    import llguidance

    try:
        return llguidance.grammar_from("grammar", text)
    except ValueError as exc:
        raise invalid_param(param, f"Invalid grammar: {exc}") from exc
