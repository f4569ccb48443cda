"""What quantization costs in quality: perplexity of a fixed text and greedy agreement on 20
prompts, for each `--quantization` method (and each `--kv-cache-dtype`) side by side,
in-process.

    python -m bench.quality [--model DIR] [--dtype auto] [--methods none,int8,int4,w8a8]
        [--kv-cache-dtypes auto,int8] [--gguf FILE.gguf] [--tokens 1024] [--prompts 20]
        [--max-tokens 32]

The text is the project's own prompt file (bench/data/prompts.jsonl, the prompts joined by
blank lines), its first --tokens tokens in one forward. Agreement compares each method's
greedy answers with the first row's: the share of output tokens before the first
divergence, how many answers are identical, and how many agree beyond near ties (identical,
or first diverging where the first row's top two logits are within 1e-3, as the tests'
oracle excuses). `--gguf` adds a row: that file served with
its own quantization (`--quantization auto`), e.g. the default model's Q4_1 GGUF beside the
float weights Loom converts it to.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.datasets import DEFAULT_PROMPTS_FILE, BenchTokenizer
from bench.datasets.prompts_file import load_prompts
from common.config import EngineConfig
from common.protocol import AddRequest
from common.sampling import SamplingParams
from engine.attention.forward_context import forward_context
from engine.core import EngineCore
from engine.platform.cpu import cpu_flags
from engine.quantization.registry import QUANTIZATION_METHODS

BLOCK_SIZE = 16


NEAR_TIE = 1e-3


@dataclass(slots=True)
class Quality:
    method: str
    perplexity: float
    answers: list[list[int]]
    seconds: float
    core: EngineCore


def quality_text(tokenizer: BenchTokenizer, num_tokens: int) -> list[int]:
    prompts = [record.prompt for record in load_prompts(DEFAULT_PROMPTS_FILE)]
    tokens = tokenizer.encode("\n\n".join(prompts))
    if len(tokens) < num_tokens:
        raise SystemExit(f"the text holds only {len(tokens)} tokens")
    return tokens[:num_tokens]


@torch.inference_mode()
def prefill_logits(core: EngineCore, tokens: list[int]) -> torch.Tensor:
    """fp32 logits after each token, in one prefill through the paged model."""
    count = len(tokens)
    blocks = list(range(-(-count // BLOCK_SIZE)))
    backend = core.runner.attention
    metadata = backend.build_metadata([count], [count], [blocks], list(range(count)),
                                      core.device)
    ids = torch.tensor(tokens, device=core.device)
    with forward_context(metadata, backend):
        hidden = core.model(ids, torch.arange(count, device=core.device), core.runner.kv_caches)
    return core.model.compute_logits(hidden).float()


def perplexity(core: EngineCore, tokens: list[int]) -> float:
    """exp(mean next-token NLL) over the text."""
    logits = prefill_logits(core, tokens)[:-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(tokens[1:], device=core.device))
    return math.exp(nll.item())


def greedy_answers(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        core.add_request(AddRequest(f"q{index}", prompt, params, 0.0))
    answers: dict[str, list[int]] = {f"q{i}": [] for i in range(len(prompts))}
    while core.has_work:
        for output in core.step().outputs:
            answers[output.request_id].extend(output.new_token_ids)
    return [answers[f"q{i}"] for i in range(len(prompts))]


def chat_prompts(tokenizer: BenchTokenizer, count: int) -> list[list[int]]:
    records = load_prompts(DEFAULT_PROMPTS_FILE)
    chats = [record.prompt for record in records if record.kind == "chat"][:count]
    return [tokenizer.encode_chat(prompt) for prompt in chats]


def measure(model: str, dtype: str, method: str, text: list[int], prompts: list[list[int]],
            max_tokens: int, label: str | None = None, kv_cache_dtype: str = "auto") -> Quality:
    started = time.perf_counter()
    core = EngineCore(EngineConfig(model, dtype=dtype, quantization=method,
                                   kv_cache_dtype=kv_cache_dtype,
                                   num_kv_blocks=len(text) // BLOCK_SIZE + 64))
    ppl = perplexity(core, text)
    answers = greedy_answers(core, prompts, max_tokens)
    if kv_cache_dtype != "auto":
        label = f"{label or method}, {kv_cache_dtype} KV"
    return Quality(label or method, ppl, answers, time.perf_counter() - started, core)


def agreement(answers: list[list[int]], reference: Quality,
              prompts: list[list[int]]) -> tuple[float, int, int]:
    """(share of tokens before the first divergence, identical answers, answers agreeing
    beyond near ties of the reference)."""
    agreed = total = identical = beyond_ties = 0
    for ours, theirs, prompt in zip(answers, reference.answers, prompts, strict=True):
        prefix = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b),
                      len(theirs))
        agreed += prefix
        total += len(theirs)
        identical += prefix == len(theirs)
        if prefix == len(theirs):
            beyond_ties += 1
        else:
            top = prefill_logits(reference.core, prompt + theirs[:prefix])[-1].topk(2).values
            beyond_ties += float(top[0] - top[1]) < NEAR_TIE
    return agreed / total, identical, beyond_ties


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quality",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--methods", default=",".join(QUANTIZATION_METHODS))
    parser.add_argument("--kv-cache-dtypes", default="auto",
                        help="each method with each of these KV caches (auto first)")
    parser.add_argument("--gguf", default=None, help="also this GGUF file, as it is")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    from common.default_model import resolve_model

    model = resolve_model(args.model)
    tokenizer = BenchTokenizer.load(model)
    text = quality_text(tokenizer, args.tokens)
    prompts = chat_prompts(tokenizer, args.prompts)
    methods = args.methods.split(",")
    results = [measure(model, args.dtype, method, text, prompts, args.max_tokens,
                       kv_cache_dtype=kv)
               for method in methods for kv in args.kv_cache_dtypes.split(",")]
    if args.gguf:
        results.append(measure(resolve_model(args.gguf), args.dtype, "auto", text, prompts,
                               args.max_tokens, label=f"{Path(args.gguf).name} (auto)"))
    reference = results[0]
    flags = " ".join(sorted(flag for flag in cpu_flags() if flag.startswith(("avx", "amx"))))
    print(f"{model}, --dtype {args.dtype}, CPU flags: {flags}")
    print(f"perplexity over {len(text)} tokens; agreement with {reference.method} on "
          f"{len(prompts)} chat prompts x {args.max_tokens} greedy tokens\n")
    print("| method | perplexity | vs " + reference.method + " | tokens agreed | identical "
          "answers | beyond near ties | load + run s |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    for result in results:
        share, identical, beyond_ties = agreement(result.answers, reference, prompts)
        change = result.perplexity / reference.perplexity - 1
        print(f"| {result.method} | {result.perplexity:.3f} | {change:+.2%} | {share:.1%} | "
              f"{identical}/{len(prompts)} | {beyond_ties}/{len(prompts)} | "
              f"{result.seconds:.1f} |")


if __name__ == "__main__":
    main()
