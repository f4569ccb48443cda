"""Which kernels a decode step runs on a GPU, and for how long: the GPU check's profile row.

    python -m bench.gpu_step_profile --model DIR [--device cuda] [--batch 1,64] [--context 128]
        [--steps 20]

For each batch size, with decode graphs (the default) and with `--enforce-eager`: the median
wall time of an in-process `EngineCore.step`, and a torch.profiler table of the same steps,
sorted by each kernel's own device time (CPU time on a CPU, where this is only a dry run).
On an H200 (docs/benchmarks.md, "GPU check") it showed a 1B model's batch-1 step as 1.71 ms
of GPU time, 0.53 of it the Triton attention kernel.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.profile_step import start_decoding
from common.config import EngineConfig
from engine.core import EngineCore

WARM_UP_STEPS = 10


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def decoding_core(model: str, device: str, eager: bool, batch: int,
                  context: int) -> EngineCore:
    """An engine whose `batch` requests have prefilled `context` tokens and decode on."""
    core = EngineCore(EngineConfig(model=model, device=device, enforce_eager=eager,
                                   kv_cache_memory=2 * 1024**3))
    start_decoding(core, batch, context, random.Random(0), WARM_UP_STEPS)
    return core


def median_step_ms(core: EngineCore, device: str, steps: int) -> float:
    times = []
    for _ in range(steps):
        synchronize(device)
        started = time.perf_counter()
        core.step()
        synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def kernel_table(core: EngineCore, device: str, steps: int, rows: int = 20) -> str:
    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as profiled:
        for _ in range(steps):
            core.step()
        synchronize(device)
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    return profiled.key_averages().table(sort_by=key, row_limit=rows,
                                         max_name_column_width=60)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_step_profile",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", default="1,64")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    for eager in (False, True):
        for batch in (int(size) for size in args.batch.split(",") if size):
            core = decoding_core(args.model, args.device, eager, batch, args.context)
            wall = median_step_ms(core, args.device, args.steps)
            label = "eager" if eager else "default (graphs on CUDA)"
            print(f"\n=== {label}, batch {batch}, {args.context}-token contexts: "
                  f"step p50 {wall:.2f} ms; {args.steps} steps profiled", flush=True)
            print(kernel_table(core, args.device, args.steps), flush=True)
            del core
            if args.device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
