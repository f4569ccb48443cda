"""How close the C++ decode attention kernel comes to streaming its KV at memory speed.

    python -m bench.decode_bandwidth [--batch 64] [--contexts 128,1000] [--layers 30]

SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64; 16-token blocks unless told), one
cache per layer with its blocks shuffled as a busy server leaves them, allocated as the engine
allocates its cache (on 2 MiB pages; `--plain-pages`: 4 KiB); each repeat runs the kernel
over every layer once, as a step does, so the figures are not a cache-warm single layer. The
kernel's GB/s counts the K and V bytes its rows read; the streaming read is `sum()` over
tensors of the same total bytes on the same threads, its GB/s the reference. `int8` and
`int8-bf16` are 8-bit caches (engine.attention.quantized_kv) read with fp32 or bf16 queries,
`fp8` and `fp8_e5m2` fp8 ones (e4m3, e5m2) read with fp32 queries.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from engine.attention.metadata import DecodeBatch
from engine.attention.quantized_kv import is_quantized, quantize_rows, row_width
from engine.kernels.paged_decode import load_cpp_decode, run_paged_decode
from engine.platform.cpu import kernel_flags
from engine.platform.huge_pages import zeros_on_huge_pages

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
# cache name -> (query dtype, cache dtype)
DTYPES = {"bf16": (torch.bfloat16, torch.bfloat16), "fp32": (torch.float32, torch.float32),
          "int8": (torch.float32, torch.int8), "int8-bf16": (torch.bfloat16, torch.int8),
          "fp8": (torch.float32, torch.float8_e4m3fn),
          "fp8_e5m2": (torch.float32, torch.float8_e5m2)}
CPU = torch.device("cpu")


def scattered_batch(batch: int, context: int, block_size: int,
                    seed: int) -> tuple[DecodeBatch, int]:
    """A decode batch whose rows' blocks are spread over the cache in random order."""
    per_row = -(-context // block_size)
    blocks = list(range(batch * per_row))
    random.Random(seed).shuffle(blocks)
    tables = torch.tensor(blocks, dtype=torch.int64).view(batch, per_row)
    decodes = DecodeBatch(rows=list(range(batch)), seq_lens=[context] * batch,
                          row_index=torch.arange(batch), lens=torch.full((batch,), context),
                          block_tables=tables, max_block=len(blocks) - 1)
    return decodes, len(blocks)


def random_cache(shape: tuple[int, ...], dtype: torch.dtype, plain_pages: bool) -> torch.Tensor:
    allocate = torch.zeros if plain_pages else partial(zeros_on_huge_pages, device=CPU)
    if not is_quantized(dtype):
        return allocate(shape, dtype=dtype).normal_()
    *rows, head_dim = shape
    cache = allocate((*rows, row_width(head_dim, dtype)), dtype=dtype)
    return cache.copy_(quantize_rows(torch.randn(*rows, head_dim).view(-1, head_dim), dtype)
                       .view(cache.shape))


def measure(batch: int, context: int, dtypes: tuple[torch.dtype, torch.dtype], block_size: int,
            layers: int, repeats: int, plain_pages: bool) -> tuple[float, float, float]:
    """(kernel ms per layer, kernel GB/s, streaming-read GB/s)."""
    decodes, num_blocks = scattered_batch(batch, context, block_size, seed=context)
    shape = (num_blocks, NUM_KV_HEADS, block_size, HEAD_DIM)
    query_dtype, dtype = dtypes
    caches = [(random_cache(shape, dtype, plain_pages), random_cache(shape, dtype, plain_pages))
              for _ in range(layers)]
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=query_dtype)
    out = torch.empty_like(q)

    def step() -> None:
        for k_cache, v_cache in caches:
            run_paged_decode(q, k_cache, v_cache, decodes, HEAD_DIM**-0.5, out)

    flat = [cache.view(-1).float() if dtype != torch.float32 else cache.view(-1)
            for pair in caches for cache in pair]
    read_bytes = sum(cache.numel() * cache.element_size() for pair in caches for cache in pair)
    # The same bytes in fp32 tensors: sum() reads each element once.
    streamed = [tensor[: tensor.numel() * dtype.itemsize // 4] for tensor in flat]
    kernel_s, stream_s = alternating_seconds(
        step, lambda: [tensor.sum() for tensor in streamed], repeats)
    return kernel_s / layers * 1e3, read_bytes / kernel_s / 1e9, read_bytes / stream_s / 1e9


def alternating_seconds(kernel: Callable[[], object], stream: Callable[[], object],
                        repeats: int) -> tuple[float, float]:
    """Median seconds of the kernel and of the streaming read, timed in turns.

    A VM's memory bandwidth drifts from minute to minute (the same read measured 29-62 GB/s in
    one sitting); timed one right after the other, both see the same minute.
    """
    kernel(), stream()
    kernel_times, stream_times = [], []
    for _ in range(repeats):
        for fn, times in ((kernel, kernel_times), (stream, stream_times)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(kernel_times), statistics.median(stream_times)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_bandwidth", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--contexts", default="128,1000")
    parser.add_argument("--dtypes", default="bf16,fp32", help=f"of {', '.join(DTYPES)}")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--plain-pages", action="store_true",
                        help="caches on 4 KiB pages (the engine asks for 2 MiB pages)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if load_cpp_decode() is None:
        raise SystemExit("the C++ decode kernel cannot be built here")
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"flags: {kernel_flags()}, torch {torch.__version__}; batch {args.batch}, "
          f"{args.layers} layers, scattered blocks of {args.block_size} tokens, "
          f"{'4 KiB' if args.plain_pages else '2 MiB'} pages\n")
    print("| cache | context | kernel ms/layer | kernel GB/s | streaming read GB/s | share |")
    print("|---|--:|--:|--:|--:|--:|")
    for name in args.dtypes.split(","):
        for context in map(int, args.contexts.split(",")):
            ms, kernel_gbs, stream_gbs = measure(args.batch, context, DTYPES[name],
                                                 args.block_size, args.layers, args.repeats,
                                                 args.plain_pages)
            print(f"| {name} | {context} | {ms:.3f} | {kernel_gbs:.1f} | {stream_gbs:.1f} | "
                  f"{100 * kernel_gbs / stream_gbs:.0f}% |", flush=True)


if __name__ == "__main__":
    main()
