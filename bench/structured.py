"""What structured outputs cost the engine, in-process on the default model.

    python -m bench.structured [--model DIR] [--dtype auto] [--batch 32] [--steps 40]

Reports (1) the build time of each grammar against the model's tokenizer (what the engine's
grammar worker does once per distinct grammar) and the frontend's validation time; (2) the
time to fill and apply the token masks of a step, per number of constrained rows; (3) the
step time p50/p99 of `--batch` running unconstrained decodes, alone and while one request's
slow grammar (a Lark grammar of 30,000 rules, >1 s to build) builds on the worker.
The served throughput with every request constrained is bench.compare's job
(`--extra-body`), see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from common.config import EngineConfig
from common.default_model import resolve_model
from common.protocol import AddRequest
from common.sampling import SamplingParams
from engine.core import EngineCore
from engine.platform.cpu import kernel_flags
from engine.sampling.grammar import Constraint, mask_logits
from frontend.structured_outputs import StructuredOutput, build_grammars
from frontend.tools import call_grammar, parse_tool_request

ORDER = {
    "type": "object",
    "properties": {
        "status": {"enum": ["new", "paid", "shipped"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                             "quantity": {"type": "integer", "minimum": 1}},
            "required": ["name", "quantity"], "additionalProperties": False}},
        "total": {"type": "number", "minimum": 0},
    },
    "required": ["status", "items", "total"],
    "additionalProperties": False,
}
LONG_ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "minLength": 2000}},
               "required": ["answer"], "additionalProperties": False}


def slow_grammar(num_rules: int = 30_000) -> str:
    """A Lark grammar of `num_rules` alternatives, each its own rule and regex: ~1.4 s to
    build at 30,000 on a 2-core EPYC (40,000 overflows llguidance's symbol table)."""
    rules = "\n".join(f'r{i}: "t{i}" /[a-z]{{1,{i % 30 + 2}}}/' for i in range(num_rules))
    return "start: " + " | ".join(f"r{i}" for i in range(num_rules)) + "\n" + rules


def grammars() -> dict[str, StructuredOutput]:
    tools = parse_tool_request({"tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}}], "tool_choice": "required"})
    assert tools is not None
    return {
        "json_object": StructuredOutput("bench", "json", {"type": "object"}),
        "nested order schema": StructuredOutput("bench", "json", ORDER),
        "2000-char answer schema": StructuredOutput("bench", "json", LONG_ANSWER),
        "regex (phone)": StructuredOutput("bench", "regex", r"\(\d{3}\) \d{3}-\d{4}"),
        "tool call (required)": call_grammar(tools, "hermes"),
        "Lark, 30,000 rules": StructuredOutput("bench", "grammar", slow_grammar()),
    }


def timed(function, *args):
    started = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - started


def build_times(core: EngineCore) -> None:
    from llguidance import LLMatcher

    tokenizer = core.grammars.tokenizer()
    print("| grammar | frontend validate ms | engine build ms |\n|---|--:|--:|")
    for name, structured in grammars().items():
        built, validate = timed(build_grammars, structured)
        _, build = timed(lambda texts: [LLMatcher(tokenizer, text) for text in texts], built)
        print(f"| {name} | {validate * 1e3:.1f} | {build * 1e3:.1f} |")


def mask_times(core: EngineCore, rows_list: list[int]) -> None:
    from llguidance import LLMatcher

    schema_grammars = build_grammars(grammars()["nested order schema"])
    tokenizer = core.grammars.tokenizer()
    vocab = core.model.config.vocab_size
    print("\n| constrained rows | mask fill + apply ms (median of 50) |\n|--:|--:|")
    for rows in rows_list:
        constraints = [Constraint([LLMatcher(tokenizer, grammar) for grammar in schema_grammars])
                       for _ in range(rows)]
        logits = torch.randn(rows, vocab)
        samples = []
        for _ in range(50):
            _, seconds = timed(mask_logits, logits.clone(), constraints)
            samples.append(seconds)
        print(f"| {rows} | {statistics.median(samples) * 1e3:.2f} |")


def step_times(core: EngineCore, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        core.admit_constrained()
        _, seconds = timed(core.step)
        times.append(seconds)
    return times


def interference(core: EngineCore, batch: int, steps: int) -> None:
    for index in range(batch):
        prompt = [(31 * index + 7 * j) % 40000 + 100 for j in range(100)]
        core.add_request(AddRequest(f"free-{index}", prompt, SamplingParams(
            max_tokens=4000, temperature=0.0, ignore_eos=True), 0.0))
    while any(r.is_prefilling for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    alone = step_times(core, steps)
    slow = build_grammars(grammars()["Lark, 30,000 rules"])
    core.add_request(AddRequest("slow", [5, 6, 7], SamplingParams(max_tokens=4, grammars=slow),
                                0.0))
    (build,) = core.awaiting_grammar["slow"].builds
    during, started = [], time.perf_counter()
    while not build.future.done():
        during += step_times(core, 1)
    print(f"\n{batch} decodes: step ms p50 / p99, alone ({len(alone)} steps) vs while a "
          f"grammar builds ({len(during)} steps, build {time.perf_counter() - started:.2f} s)")
    print("| window | p50 ms | p99 ms |\n|---|--:|--:|")
    for name, samples in (("alone", alone), ("during the build", during)):
        ordered = sorted(samples)
        p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
        print(f"| {name} | {statistics.median(samples) * 1e3:.1f} | {p99 * 1e3:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.structured")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    core = EngineCore(EngineConfig(model=resolve_model(args.model), dtype=args.dtype,
                                   grammar_compile_timeout=60.0))
    print(f"flags: {kernel_flags()}; torch {torch.__version__}; {core.dtype}; "
          f"{torch.get_num_threads()} threads\n")
    build_times(core)
    mask_times(core, [1, 8, 32])
    interference(core, args.batch, args.steps)
    print(json.dumps({"grammar_worker_builds": core.grammars.num_built}))


if __name__ == "__main__":
    main()
