"""Prefill/decode disaggregation against colocated engines, on a mixed workload.

    python -m bench.disaggregation [--model DIR] [--streams 8] [--output-len 128]
        [--burst-size 2] [--burst-every 6] [--long-prompt 2000] [--duration 60]
        [--ttft-slo 4] [--itl-slo 0.5] [--save-json FILE]

Each layout gets a freshly launched server with two engines on the same cores:
`colocated` (`-dp 2`, cache-aware routing) and `disaggregated` (`-dp 2 --kv-roles
prefill,decode`). The workload: `--streams` closed-loop clients each stream ~100-token
prompts with `--output-len` tokens (steady decoding), and every `--burst-every` seconds
`--burst-size` requests with `--long-prompt`-token prompts (distinct, so no prefix hits)
arrive at once, each with 16 output tokens. Reported per layout: the steady streams' ITL
p50/p99, the long prompts' TTFT p50/p99, goodput (requests a second that met both SLOs:
TTFT <= --ttft-slo and every ITL <= --itl-slo), and the KV bytes relayed per prompt token
handed over (from /metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.compare import machine
from bench.launched import LoomServer
from bench.metrics import Distribution, RequestRecord
from bench.serve import fetch_metrics, served_model, stream_one

LAYOUTS = {"colocated": ["--data-parallel-size", "2"],
           "disaggregated": ["--data-parallel-size", "2", "--kv-roles", "prefill,decode"]}
WORDS = ["river", "stone", "cloud", "lamp", "garden", "window", "harbor", "letter", "bridge",
         "candle", "forest", "orbit", "meadow", "signal", "copper", "violet", "thunder"]


def long_prompt(tokens: int, salt: int) -> list[int]:
    """Token ids (not text), so the length is exact; distinct per salt."""
    return [(salt * 7919 + i * 31) % 20000 + 200 for i in range(tokens)]


def short_prompt(index: int) -> str:
    words = [WORDS[(index * 5 + i) % len(WORDS)] for i in range(60)]
    return f"Request {index}: write a story using these words: " + " ".join(words)


@dataclass(slots=True)
class LayoutResult:
    layout: str
    stream_records: list[RequestRecord] = field(default_factory=list)
    long_records: list[RequestRecord] = field(default_factory=list)
    duration_s: float = 0.0
    transfer_bytes: float = 0.0
    transfer_tokens: float = 0.0

    def summary(self, ttft_slo: float, itl_slo: float) -> dict[str, float | str | int | None]:
        itls = Distribution.of_seconds([i for r in self.stream_records if r.success
                                        for i in r.itls])
        ttft_values = [r.ttft for r in self.long_records if r.success and r.ttft is not None]
        ttfts = Distribution.of_seconds(ttft_values)
        records = [r for r in self.stream_records + self.long_records if r.success]
        good = sum(1 for r in records if r.ttft is not None and r.ttft <= ttft_slo
                   and all(i <= itl_slo for i in r.itls))
        return {
            "layout": self.layout,
            "stream_itl_p50_ms": itls.median,
            "stream_itl_p99_ms": itls.p99,
            "long_ttft_p50_ms": ttfts.median,
            "long_ttft_p99_ms": ttfts.p99,
            "long_done": len(ttft_values),
            "failed": sum(1 for r in self.stream_records + self.long_records if not r.success),
            "goodput_rps": good / self.duration_s,
            "kv_bytes_per_token": (self.transfer_bytes / self.transfer_tokens
                                   if self.transfer_tokens else 0.0),
        }


async def run_layout(layout: str, args: argparse.Namespace) -> LayoutResult:
    launch = [*LAYOUTS[layout], *(["--model", args.model] if args.model else [])]
    result = LayoutResult(layout)
    with LoomServer(launch_args=launch) as server:
        url = server.base_url + "/v1/completions"
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None)) as http:
            model = await served_model(http, server.base_url)
            stop_at = time.perf_counter() + args.duration

            async def stream_client(client: int) -> None:
                index = client
                while time.perf_counter() < stop_at:
                    record = RequestRecord(prompt_len=0, max_tokens=args.output_len)
                    await stream_one(http, url, body(model, short_prompt(index), args.output_len),
                                     record, chat=False)
                    result.stream_records.append(record)
                    index += args.streams

            async def bursts() -> None:
                salt, pending = 0, []
                await asyncio.sleep(args.burst_every / 2)
                while time.perf_counter() < stop_at:
                    for _ in range(args.burst_size):
                        record = RequestRecord(prompt_len=args.long_prompt, max_tokens=16)
                        result.long_records.append(record)
                        pending.append(asyncio.ensure_future(stream_one(
                            http, url, body(model, long_prompt(args.long_prompt, salt), 16),
                            record, chat=False)))
                        salt += 1
                    await asyncio.sleep(args.burst_every)
                await asyncio.gather(*pending)

            started = time.perf_counter()
            await asyncio.gather(bursts(), *(stream_client(c) for c in range(args.streams)))
            result.duration_s = time.perf_counter() - started
            snapshot = await fetch_metrics(http, server.base_url)
    samples = snapshot.samples if snapshot is not None else {}
    result.transfer_bytes = samples.get("loom:kv_transfer_bytes_total", 0.0)
    result.transfer_tokens = samples.get("loom:prefix_cache_transfer_hits_total", 0.0)
    return result


def body(model: str, prompt: str | list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--burst-size", type=int, default=2)
    parser.add_argument("--burst-every", type=float, default=6.0)
    parser.add_argument("--long-prompt", type=int, default=2000)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--ttft-slo", type=float, default=4.0)
    parser.add_argument("--itl-slo", type=float, default=0.5)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--save-json", type=Path, default=None)
    args = parser.parse_args(argv)
    print(machine())
    rows = []
    for layout in args.layouts.split(","):
        result = asyncio.run(run_layout(layout, args))
        rows.append(result.summary(args.ttft_slo, args.itl_slo))
        print(json.dumps(rows[-1]), flush=True)
    keys = list(rows[0])
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v)
                                for v in row.values()) + " |")
    if args.save_json is not None:
        args.save_json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
