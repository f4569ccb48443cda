"""Shared-prefix benchmark: prefix caching on vs off, side by side in one run.

    python -m bench.prefix_cache [--num-prompts 64] [--prefix-len 1000] [--question-len 50]
                                 [--output-len 64] [--dtype float32]

Every request shares one long system prompt and adds its own question; all arrive at once.
Reports TTFT p50/p90, total time, output tok/s and the prefix-cache hit rate per setting.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path

from common.config import EngineConfig
from common.default_model import resolve_model
from common.protocol import AddRequest
from common.sampling import SamplingParams
from engine.block_manager import PrefixCacheStats
from engine.core import EngineCore, EngineTotals
from engine.weights.loader import read_hf_config


def make_prompts(count: int, prefix_len: int, question_len: int, vocab: int,
                 seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(100, vocab) for _ in range(prefix_len)]
    return [system + [rng.randrange(100, vocab) for _ in range(question_len)]
            for _ in range(count)]


def run(config: EngineConfig, prompts: list[list[int]], output_len: int) -> dict:
    core = EngineCore(config)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    core.add_request(AddRequest("warmup", [7] * 40, params, time.time()))
    while core.has_work:
        core.step()
    core.block_manager.stats = PrefixCacheStats()
    core.totals = EngineTotals()
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        core.add_request(AddRequest(f"p{index}", prompt, params, time.time()))
    first_token_at: dict[str, float] = {}
    output_tokens = 0
    while core.has_work:
        for output in core.step().outputs:
            first_token_at.setdefault(output.request_id, time.perf_counter() - started)
            output_tokens += len(output.new_token_ids)
    duration = time.perf_counter() - started
    assert core.check_integrity() == [], "KV blocks leaked"
    ttfts = sorted(first_token_at.values())
    stats = core.block_manager.stats
    result = {
        "prefix_caching": config.enable_prefix_caching,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "total_s": duration,
        "output_tok_per_s": output_tokens / duration,
        "prefill_tokens": core.totals.num_prompt_tokens,
        "hit_rate": stats.hits / stats.queries if stats.queries else 0.0,
    }
    del core
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix_cache")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--question-len", type=int, default=50)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    vocab = read_hf_config(Path(model_dir))["vocab_size"]
    prompts = make_prompts(args.num_prompts, args.prefix_len, args.question_len, vocab,
                           args.seed)
    results = []
    for caching in (True, False):
        config = EngineConfig(model=model_dir, dtype=args.dtype, enable_prefix_caching=caching,
                              max_num_seqs=args.num_prompts)
        results.append(run(config, prompts, args.output_len))
        print(json.dumps(results[-1]), flush=True)
    print(f"\n{args.num_prompts} requests sharing a {args.prefix_len}-token prefix, "
          f"{args.question_len}-token questions, {args.output_len} output tokens, "
          f"dtype {args.dtype}\n")
    print("| prefix caching | TTFT p50 s | TTFT p90 s | total s | output tok/s "
          "| prefill tokens | hit rate |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {'on' if r['prefix_caching'] else 'off'} | {r['ttft_p50_s']:.2f} | "
              f"{r['ttft_p90_s']:.2f} | {r['total_s']:.1f} | {r['output_tok_per_s']:.1f} | "
              f"{r['prefill_tokens']} | {r['hit_rate']:.1%} |")
    on, off = results
    print(f"\nTTFT p50 off/on: {off['ttft_p50_s'] / on['ttft_p50_s']:.1f}x, "
          f"total time off/on: {off['total_s'] / on['total_s']:.1f}x")


if __name__ == "__main__":
    main()
