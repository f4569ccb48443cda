"""Several tenants at once against one server: does a light tenant keep its latency while a
heavy one floods, and do weights split the output?

    python -m bench.tenants --base-url http://127.0.0.1:8000 \\
        --tenant heavy:sk-heavy:8 --tenant light:sk-light:0.4 \\
        [--duration 60] [--input-len 256] [--output-len 128] [--endpoint /v1/completions]
        [--save-json F]

`--tenant NAME:KEY:RATE` (repeated): that tenant sends requests with `Authorization: Bearer
KEY`, Poisson arrivals of RATE requests per second, for --duration seconds (RATE `inf`: all at
once, --burst requests each). Against a server started with --tenants the keys pick the
tenants; against one without (FCFS, any key) the same run gives the baseline beside it. The
report gives, per tenant: requests done, refused (HTTP status counts), TTFT p50 / p99,
output tokens (the server's usage counts), its share of all output tokens, and its share in
the window (`window`): output received while arrivals went on and every tenant still had a
request to start. A burst (RATE `inf`) that outlasts --duration keeps a tenant saturated.
Each tenant's requests go out from a client process of its own, as separate clients' would.

To measure issue 32's fairness figures: find the server's capacity C (requests/s that
bench.serve sustains), then run heavy at 4C and light at 0.2C against `--tenants` and
against FCFS, and light alone; for the weight split, two tenants of weights 2 and 1 both
above C, whose output shares should come out 2:1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.metrics import Distribution, RequestRecord
from bench.run_result import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT
from bench.serve import STREAM_READ_TIMEOUT_S, arrival_offsets, served_model, stream_one

PROMPT_WORD = "loom "  # about one token each with most tokenizers
PROCESS_START_S = 2.0  # for each tenant's client process to start (~0.6 s here)


@dataclass(frozen=True, slots=True)
class TenantLoad:
    name: str
    key: str
    rate: float  # requests per second; inf: a burst at the start

    @classmethod
    def parse(cls, text: str) -> TenantLoad:
        name, _, rest = text.partition(":")
        key, _, rate_text = rest.rpartition(":")
        try:
            rate = float(rate_text)
        except ValueError:
            rate = math.nan
        if not name or not key or not rate > 0:
            raise argparse.ArgumentTypeError(
                f"--tenant wants NAME:KEY:RATE (RATE requests/s above 0, or inf), got {text!r}")
        return cls(name, key, rate)


@dataclass(slots=True)
class TenantReport:
    name: str
    rate: float
    completed: int
    refused: dict[str, int]  # "HTTP 429" -> count
    ttft_ms: Distribution
    output_tokens: int
    window_chunks: int = 0  # streamed output chunks (~tokens) received while arrivals went on
    # and every tenant still had requests to start (bench.tenants.backlog_end)
    output_share: float = 0.0  # of every tenant's output tokens
    window_share: float = 0.0  # of every tenant's chunks in the window: the share under
    # saturation

    @classmethod
    def of(cls, load: TenantLoad, records: list[RequestRecord],
           window_end: float = math.inf) -> TenantReport:
        done = [record for record in records if record.success]
        refused = Counter((record.error or "").split(":")[0] for record in records
                          if not record.success)
        return cls(load.name, load.rate, len(done), dict(refused),
                   Distribution.of_seconds([r.ttft for r in done if r.ttft is not None]),
                   sum(r.usage_output_tokens or 0 for r in done),
                   sum(time <= window_end for r in records for time in r.chunk_times))


def with_shares(reports: list[TenantReport]) -> list[TenantReport]:
    total = sum(report.output_tokens for report in reports)
    in_window = sum(report.window_chunks for report in reports)
    for report in reports:
        report.output_share = report.output_tokens / total if total else 0.0
        report.window_share = report.window_chunks / in_window if in_window else 0.0
    return reports


def format_reports(reports: list[TenantReport], duration_s: float) -> str:
    lines = [f"{'tenant':<16}{'rate/s':>8}{'done':>7}{'refused':>18}{'TTFT p50 ms':>13}"
             f"{'TTFT p99 ms':>13}{'out tok':>10}{'out tok/s':>11}{'share':>8}{'window':>8}"]
    for report in reports:
        refused = ", ".join(f"{k}: {v}" for k, v in sorted(report.refused.items())) or "-"
        ttft = report.ttft_ms
        lines.append(
            f"{report.name:<16}{report.rate:>8g}{report.completed:>7}{refused:>18}"
            f"{_ms(ttft.median):>13}{_ms(ttft.p99):>13}{report.output_tokens:>10}"
            f"{report.output_tokens / duration_s if duration_s else 0:>11.1f}"
            f"{report.output_share:>8.1%}{report.window_share:>8.1%}")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


@dataclass(slots=True)
class TenantRun:
    load: TenantLoad
    records: list[RequestRecord] = field(default_factory=list)


async def run_tenant(run: TenantRun, url: str, body: dict[str, Any], duration_s: float,
                     burst: int, seed: int, chat: bool) -> None:
    count = burst if math.isinf(run.load.rate) else max(1, round(run.load.rate * duration_s))
    offsets = arrival_offsets(count, run.load.rate, 1.0, seed)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=STREAM_READ_TIMEOUT_S)
    headers = {"Authorization": f"Bearer {run.load.key}"}
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers,
                                     connector=connector) as session:
        origin = time.perf_counter()
        tasks = []
        for offset in offsets:
            delay = origin + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            record = RequestRecord(0, body["max_tokens"])
            run.records.append(record)
            tasks.append(asyncio.create_task(stream_one(session, url, body, record, chat)))
        await asyncio.gather(*tasks)


def run_tenant_process(load: TenantLoad, url: str, body: dict[str, Any], duration_s: float,
                       burst: int, seed: int, chat: bool, start_at: float) -> list[RequestRecord]:
    """One tenant's load in a process of its own, as a separate client would send it: a
    client busy streaming a flooding tenant's answers delays the light tenant's chunks
    (its event loop lagged up to 136 ms in a 60 s run), which no server can help.
    Arrivals start at `start_at` (perf_counter, which all processes here share)."""
    run = TenantRun(load)

    async def send() -> None:
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        await run_tenant(run, url, body, duration_s, burst, seed, chat)

    asyncio.run(send())
    return run.records


async def warm_up(url: str, body: dict[str, Any], headers: dict[str, str], chat: bool) -> None:
    """One short request of the run's prompt first, so no tenant's first request pays for a
    fresh server's one-time work (kernel builds, the prompt's first prefill)."""
    record = RequestRecord(0, 4)
    async with aiohttp.ClientSession(headers=headers) as session:
        await stream_one(session, url, body | {"max_tokens": 4}, record, chat)
    if not record.success:
        raise RuntimeError(f"warm-up request to {url} failed: {record.error}")


def backlog_end(runs: list[TenantRun]) -> float:
    """When the first tenant ran out of requests to start: the earliest, over tenants, of its
    last request's first chunk. Until then every tenant had work queued (saturation, for
    tenants sending above their share); after it the others share what it leaves."""
    return min(max((record.chunk_times[0] for record in run.records if record.chunk_times),
                   default=math.inf) for run in runs)


async def run_all(args: argparse.Namespace) -> tuple[list[TenantReport], float]:
    chat = args.endpoint == CHAT_ENDPOINT
    first_key = {"Authorization": f"Bearer {args.tenant[0].key}"}  # /v1/models needs one
    async with aiohttp.ClientSession(headers=first_key) as session:
        model = args.model or await served_model(session, args.base_url)
    prompt = PROMPT_WORD * args.input_len
    body: dict[str, Any] = {"model": model, "max_tokens": args.output_len, "stream": True,
                            "temperature": 0.0, "ignore_eos": args.ignore_eos,
                            "stream_options": {"include_usage": True}}
    body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    if args.warmup:
        await warm_up(args.base_url + args.endpoint, body, first_key, chat)
    loop = asyncio.get_running_loop()
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(len(args.tenant), mp_context=spawn) as pool:
        started = time.perf_counter() + PROCESS_START_S
        records = await asyncio.gather(*(
            loop.run_in_executor(pool, run_tenant_process, load, args.base_url + args.endpoint,
                                 body, args.duration, args.burst, args.seed + index, chat,
                                 started)
            for index, load in enumerate(args.tenant)))
    duration = time.perf_counter() - started
    runs = [TenantRun(load, tenant_records)
            for load, tenant_records in zip(args.tenant, records, strict=True)]
    window_end = min(started + args.duration, backlog_end(runs))
    return with_shares([TenantReport.of(run.load, run.records, window_end)
                        for run in runs]), duration


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.tenants",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None)
    parser.add_argument("--tenant", type=TenantLoad.parse, action="append", required=True,
                        metavar="NAME:KEY:RATE")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--burst", type=int, default=64, help="requests of an inf-rate tenant")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--endpoint", default=COMPLETIONS_ENDPOINT,
                        choices=(COMPLETIONS_ENDPOINT, CHAT_ENDPOINT))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="one untimed request first")
    parser.add_argument("--save-json", type=Path, default=None)
    args = parser.parse_args(argv)
    names = [load.name for load in args.tenant]
    if len(set(names)) != len(names):
        parser.error(f"tenant names repeat: {names}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reports, duration = asyncio.run(run_all(args))
    print(format_reports(reports, duration))
    if args.save_json is not None:
        args.save_json.write_text(json.dumps({"duration_s": duration,
                                              "tenants": [asdict(r) for r in reports]},
                                             indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
