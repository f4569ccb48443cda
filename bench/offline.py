"""Offline engine benchmark: the engine in-process (no HTTP), several batching modes side by side.

    python -m bench.offline [--model DIR] [--num-prompts 64] [--input-len 100]
                            [--output-len 128] [--dtype auto] [--modes continuous,static,seqs1]

Each mode runs the same requests (random prompt tokens around --input-len, --output-len
tokens forced with ignore_eos) on a fresh engine and reports output tok/s, total tok/s,
step time p50/p99 and preemptions. `seqs1` is continuous batching with --max-num-seqs 1;
it runs --single-prompts requests (it is slow, and its rate does not depend on the count).
`sampling` is continuous batching with every sampling parameter active (temperature, top-p,
top-k, min-p, three penalties, logit bias, seeds, min_tokens, logprobs).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from common.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from common.default_model import resolve_model
from common.protocol import AddRequest
from common.sampling import SamplingParams
from engine.core import EngineCore, choose_device
from engine.platform.cpu import choose_dtype
from engine.weights.loader import read_hf_config

MODES = {
    "continuous": {"batching": "continuous"},
    "static": {"batching": "static"},
    "seqs1": {"batching": "continuous", "max_num_seqs": 1},
    "sampling": {"batching": "continuous"},  # continuous, every sampling parameter active
}


def sampling_for(mode: str, index: int, output_len: int) -> SamplingParams:
    if mode != "sampling":
        return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    return SamplingParams(
        max_tokens=output_len, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=50,
        min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5,
        logit_bias={100: 2.0, 200: -2.0}, seed=index, min_tokens=4, logprobs=5)


@dataclass(slots=True)
class ModeResult:
    mode: str
    num_requests: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    step_times_s: list[float]
    preemptions: int

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def total_throughput(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.duration_s

    def step_percentile(self, fraction: float) -> float:
        ordered = sorted(self.step_times_s)
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] * 1000


def make_requests(mode: str, count: int, input_len: int, output_len: int, vocab: int,
                  seed: int) -> list[AddRequest]:
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        length = rng.randint(int(input_len * 0.8), int(input_len * 1.2))
        prompt = [rng.randrange(100, vocab) for _ in range(length)]
        requests.append(AddRequest(f"bench-{index}", prompt,
                                   sampling_for(mode, index, output_len), time.time()))
    return requests


def run_mode(mode: str, base: EngineConfig, requests: list[AddRequest]) -> ModeResult:
    core = EngineCore(replace(base, **MODES[mode]))
    warmup = AddRequest("warmup", requests[0].prompt_token_ids,
                        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), 0.0)
    core.add_request(warmup)
    while core.has_work:
        core.step()
    for request in requests:
        core.add_request(request)
    step_times, output_tokens = [], 0
    started = time.perf_counter()
    while core.has_work:
        outputs = core.step()
        step_times.append(outputs.stats.step_time_s)
        output_tokens += sum(len(o.new_token_ids) for o in outputs.outputs)
    duration = time.perf_counter() - started
    assert core.check_integrity() == [], "KV blocks leaked"
    result = ModeResult(mode, len(requests), duration,
                        sum(len(r.prompt_token_ids) for r in requests), output_tokens,
                        step_times, core.scheduler.num_preemptions)
    del core
    gc.collect()
    return result


def median_run(results: list[ModeResult]) -> ModeResult:
    """The run with the median output throughput."""
    ordered = sorted(results, key=lambda r: r.output_throughput)
    return ordered[(len(ordered) - 1) // 2]


def print_table(results: list[ModeResult]) -> None:
    print("| mode | requests | output tok/s | total tok/s | step p50 ms | step p99 ms "
          "| preemptions | duration s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.mode} | {r.num_requests} | {r.output_throughput:.1f} | "
              f"{r.total_throughput:.1f} | {r.step_percentile(0.5):.1f} | "
              f"{r.step_percentile(0.99):.1f} | {r.preemptions} | {r.duration_s:.1f} |")
    by_mode = {r.mode: r for r in results}
    if "continuous" in by_mode:
        for other in ("static", "seqs1", "sampling"):
            if other in by_mode:
                ratio = by_mode["continuous"].output_throughput / by_mode[other].output_throughput
                print(f"continuous / {other} output tok/s: {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.offline")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto", help="auto: what `launch.py` would pick")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--single-prompts", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    parser.add_argument("--kv-cache-memory", type=int, default=None)
    parser.add_argument("--modes", default="continuous,static,seqs1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--quantization", "-q", default="auto",
                        help="as launch.py's flag: auto, none, int8, int4, w8a8")
    args = parser.parse_args()
    base = EngineConfig(model=resolve_model(args.model), dtype=args.dtype, device=args.device,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.num_prompts,
                        quantization=args.quantization)
    vocab_size = read_hf_config(Path(base.model))["vocab_size"]
    runs: dict[str, list[ModeResult]] = {mode: [] for mode in args.modes.split(",")}
    for repeat in range(args.repeats):  # round-robin, so drift on a shared machine hits all
        for mode, results in runs.items():
            count = args.single_prompts if mode == "seqs1" else args.num_prompts
            requests = make_requests(mode, count, args.input_len, args.output_len, vocab_size,
                                     args.seed)
            result = run_mode(mode, base, requests)
            print(f"[{repeat + 1}/{args.repeats}] {mode}: {result.output_throughput:.1f} "
                  f"output tok/s (median step "
                  f"{statistics.median(result.step_times_s) * 1000:.1f} ms)", flush=True)
            results.append(result)
    dtype = str(choose_dtype(args.dtype, choose_device(args.device))).removeprefix("torch.")
    print(f"\nmodel {base.model}, dtype {dtype}, {args.num_prompts} prompts of "
          f"~{args.input_len} tokens, {args.output_len} output tokens forced, "
          f"median of {args.repeats} round-robin runs\n")
    print_table([median_run(results) for results in runs.values()])


if __name__ == "__main__":
    main()
