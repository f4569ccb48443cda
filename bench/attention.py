"""Per-layer paged attention timings: the reference oracle vs the fast path.

    python -m bench.attention [--repeats N] [--threads N]

Shapes follow SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64) with 16-token blocks.
Each figure is the median of N calls of one layer (K/V write included): `torch` is the torch
backend, `cpp` the C++ one as the selector builds it (with the AMX prefill kernel for bf16
chunks where the CPU has tiles); `plan` is the once-per-step cost of the
torch backend's metadata builder, shared by all 30 layers. On a machine
shared with other work, run with OMP_WAIT_POLICY=passive (spinning OpenMP workers that lose
their core turn every parallel op into a scheduler quantum) or --threads 1.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend
from engine.attention.cpu_backend import CpuBackend
from engine.attention.metadata import AttentionMetadata
from engine.attention.reference import reference_attention, write_kv
from engine.attention.torch_backend import TorchBackend, decode_kernel_for
from engine.kernels.paged_prefill import tiled_prefill_supports
from engine.platform.cpu import native_bf16_matmul

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


@dataclass(frozen=True)
class Config:
    name: str
    requests: list[tuple[int, int]]  # (query_len, seq_len), decodes first


def decode_batch(batch: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(1, rng.randint(100, 1000)) for _ in range(batch)]


CONFIGS = [
    Config("decode b=1", decode_batch(1)),
    Config("decode b=16", decode_batch(16)),
    Config("decode b=64", decode_batch(64)),
    Config("prefill 512", [(512, 512)]),
    Config("prefill 512 on 512 cached", [(512, 1024)]),
    Config("prefill 2048", [(2048, 2048)]),
    Config("prefill 1024 on 1024 cached", [(1024, 2048)]),
    Config("mixed 62 decodes + 2 chunks", [*decode_batch(62), (256, 256), (256, 768)]),
]


@dataclass
class Setup:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    build: Callable[[AttentionBackend], AttentionMetadata]


def make_setup(config: Config, dtype: torch.dtype) -> Setup:
    needed = [-(-seq_len // BLOCK_SIZE) for _, seq_len in config.requests]
    blocks = list(range(sum(needed)))
    random.Random(1).shuffle(blocks)
    tables = [[blocks.pop() for _ in range(n)] for n in needed]
    slots = [
        table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        for (query_len, seq_len), table in zip(config.requests, tables, strict=True)
        for pos in range(seq_len - query_len, seq_len)
    ]
    cache_shape = (sum(needed), NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    query_lens = [query_len for query_len, _ in config.requests]
    seq_lens = [seq_len for _, seq_len in config.requests]
    return Setup(
        q=torch.randn(len(slots), NUM_HEADS, HEAD_DIM, dtype=dtype),
        k=torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, dtype=dtype),
        v=torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, dtype=dtype),
        k_cache=torch.randn(cache_shape, dtype=dtype),
        v_cache=torch.randn(cache_shape, dtype=dtype),
        build=lambda backend: backend.build_metadata(query_lens, seq_lens, tables, slots, "cpu"),
    )


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench(config: Config, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    s = make_setup(config, dtype)
    torch_backend = TorchBackend(BLOCK_SIZE, NUM_KV_HEADS,
                                 decode_kernel_for(torch.device("cpu"), dtype))
    metadata = s.build(torch_backend)
    scale = HEAD_DIM**-0.5

    def reference() -> torch.Tensor:
        write_kv(s.k, s.v, s.k_cache, s.v_cache, metadata.slot_mapping)
        return reference_attention(s.q, s.k_cache, s.v_cache, metadata, scale)

    def run(backend: AttentionBackend, planned: AttentionMetadata) -> Callable[[], torch.Tensor]:
        return lambda: backend.forward(s.q, s.k, s.v, s.k_cache, s.v_cache, planned, scale)

    figures = {"reference": median_ms(reference, max(3, repeats // 4)),
               "torch": median_ms(run(torch_backend, metadata), repeats)}
    if CpuBackend.supports(torch.device("cpu"), dtype, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM):
        cpu_backend = CpuBackend(BLOCK_SIZE, NUM_KV_HEADS,
                                 tiled_prefill_supports(dtype, HEAD_DIM, BLOCK_SIZE))
        figures["cpp"] = median_ms(run(cpu_backend, s.build(cpu_backend)), repeats)
    figures["plan"] = median_ms(lambda: s.build(torch_backend), repeats)
    return figures



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU "
          f"{torch.backends.cpu.get_cpu_capability()}, native bf16 matmul: "
          f"{native_bf16_matmul()}; H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} "
          f"block={BLOCK_SIZE}; ms per layer (median of {args.repeats})")
    columns = ("reference", "torch", "cpp", "plan")
    print(f"{'config':28} {'dtype':9}" + "".join(f"{c:>10}" for c in columns) + "   speedup")
    for dtype in (torch.bfloat16, torch.float32):
        for config in CONFIGS:
            figures = bench(config, dtype, args.repeats)
            cells = "".join(f"{figures[c]:10.2f}" if c in figures else f"{'-':>10}"
                            for c in columns)
            best = min(figures.get("cpp", figures["torch"]), figures["torch"])
            print(f"{config.name:28} {str(dtype).removeprefix('torch.'):9}{cells}"
                  f"   {figures['reference'] / best:6.1f}x", flush=True)


if __name__ == "__main__":
    main()
