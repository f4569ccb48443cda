"""The Triton paged-attention kernel alone: its time per launch over decode rows of a
scattered paged cache, by tile (tokens a program reads per iteration) and warps.

    python -m bench.triton_attention [--shapes 32/8x64,9/3x64,32/8x128] [--batch 1,64]
        [--context 128,1000] [--tiles 16,32,64,128] [--warps 4,8] [--device cuda]

On CUDA each configuration's launches are captured in one CUDA graph and replayed, so the
figure is the kernel's own time, not the launch's; GB/s is the KV it reads over that time.
As in a served step, whose GEMMs stream the weights between two layers' attention, the KV
comes from memory, not the GPU's L2: a small problem is copied over a pool of
`COLD_BYTES`, each launch of the graph reading its own copy.
On the CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1): a dry run only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from engine.attention.triton_kernels import QueryRows, paged_attention

BLOCK_SIZE = 16
LAUNCHES_PER_GRAPH = 20
COLD_BYTES = 128 * 1024**2  # over an H200's 50 MB of L2
MAX_COPIES = 512


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        heads, rest = text.split("/")
        kv_heads, head_dim = rest.split("x")
        return cls(int(heads), int(kv_heads), int(head_dim))

    def __str__(self) -> str:
        return f"{self.heads}/{self.kv_heads}x{self.head_dim}"


@dataclass
class Problem:
    """`copies` problems over one pool: a query and a block table each."""

    queries: list[torch.Tensor]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: list[torch.Tensor]
    rows: QueryRows


def kv_bytes(shape: Shape, batch: int, context: int, dtype: torch.dtype) -> int:
    """The K and V one launch reads."""
    return 2 * batch * context * shape.kv_heads * shape.head_dim * dtype.itemsize


def decode_problem(shape: Shape, batch: int, context: int, device: str,
                   dtype: torch.dtype, copies: int = 1) -> Problem:
    """`batch` decode rows of `context` tokens each, `copies` times over one pool, every
    table a random choice of its blocks (as a busy server leaves them)."""
    generator = torch.Generator().manual_seed(0)
    blocks_per_row = -(-context // BLOCK_SIZE)
    num_blocks = copies * batch * blocks_per_row
    cache_shape = (num_blocks, shape.kv_heads, BLOCK_SIZE, shape.head_dim)
    k_cache = torch.randn(cache_shape, generator=generator).to(device, dtype)
    v_cache = torch.randn(cache_shape, generator=generator).to(device, dtype)
    order = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    tables = [part.reshape(batch, blocks_per_row).to(device) for part in order.chunk(copies)]
    queries = [torch.randn(batch, shape.heads, shape.head_dim, generator=generator)
               .to(device, dtype) for _ in range(copies)]
    rows = QueryRows(torch.arange(batch, dtype=torch.int32, device=device),
                     torch.full((batch,), context, dtype=torch.int32, device=device))
    return Problem(queries, k_cache, v_cache, tables, rows)


def cold_copies(shape: Shape, batch: int, context: int, dtype: torch.dtype) -> int:
    """How many copies of a problem fill `COLD_BYTES` of KV."""
    return max(1, min(MAX_COPIES, -(-COLD_BYTES // kv_bytes(shape, batch, context, dtype))))


@dataclass(frozen=True)
class Launch:
    tile: int
    warps: int


def launch_us(problem: Problem, launch: Launch, repeats: int) -> float:
    """Median time of one launch, in microseconds."""
    def attend(copy: int) -> torch.Tensor:
        return paged_attention(problem.queries[copy], problem.k_cache, problem.v_cache,
                               problem.tables[copy], problem.rows,
                               problem.queries[0].shape[-1] ** -0.5, tile_tokens=launch.tile,
                               num_warps=launch.warps)

    attend(0)  # compiles
    if problem.k_cache.device.type != "cuda":
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            attend(0)
            times.append((time.perf_counter() - started) * 1e6)
        return statistics.median(times)
    launches = max(LAUNCHES_PER_GRAPH, len(problem.queries))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for index in range(launches):
            attend(index % len(problem.queries))
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)


def sweep(shapes: list[Shape], batches: list[int], contexts: list[int],
          launches: list[Launch], device: str, dtype: torch.dtype, repeats: int) -> list[str]:
    """One markdown row per configuration, the fastest launch of each problem starred."""
    lines = ["| shape (heads/kv x dim) | batch | context | tile | warps | us | GB/s |",
             "|---|--:|--:|--:|--:|--:|--:|"]
    for shape in shapes:
        for batch in batches:
            for context in contexts:
                copies = cold_copies(shape, batch, context, dtype) if device == "cuda" else 1
                problem = decode_problem(shape, batch, context, device, dtype, copies)
                timed = {launch: launch_us(problem, launch, repeats) for launch in launches}
                best = min(timed, key=timed.get)
                read = kv_bytes(shape, batch, context, dtype)
                for launch, us in timed.items():
                    mark = " *" if launch == best else ""
                    lines.append(f"| {shape} | {batch} | {context} | {launch.tile} | "
                                 f"{launch.warps}{mark} | {us:.1f} | "
                                 f"{read / us / 1e3:.0f} |")
                del problem
    return lines


def integers(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.triton_attention",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="32/8x64,9/3x64,32/8x128")
    parser.add_argument("--batch", default="1,64")
    parser.add_argument("--context", default="128,1000")
    parser.add_argument("--tiles", default="16,32,64,128")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    launches = [Launch(tile, warps) for tile in integers(args.tiles)
                for warps in integers(args.warps)]
    lines = sweep([Shape.parse(text) for text in args.shapes.split(",")], integers(args.batch),
                  integers(args.context), launches, args.device, getattr(torch, args.dtype),
                  args.repeats)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
