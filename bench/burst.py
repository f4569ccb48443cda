"""The process split, measured: running streams while a burst of over-long prompts arrives.

    python -m bench.burst [--model DIR | --base-url URL] [--launch-args "..."]
        [--concurrency 32] [--burst-size 20] [--prompt-chars 100000] [--output-len 128]
        [--input-len 100] [--burst-delay 3] [--duration 10] [--endpoint ...]
        [--save-json FILE]

Loom decodes steadily at concurrency C (closed loop: each of C clients sends its next
streaming request, ~100-token prompt from the prompts file with max_tokens forced by
ignore_eos, as soon as its previous one ends). `--burst-delay` seconds after all C streams
have produced their first token, B requests with `--prompt-chars`-character prompts are sent
at once; past the model's context they are tokenized by the frontend and refused with 400.
The same workload runs twice, without and with the burst, and each run reports over the
window [burst, burst + duration] (the no-burst run marks the same moment): running streams'
ITL, the engine's step time from `/metrics` (loom:step_time_seconds, its increase over the
window) and the burst requests' status and latency. Started by bench.burst, each run gets a
freshly launched server, so neither finds the other's prompts in the prefix cache; with
--base-url both runs share that server.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shlex
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from bench.compare import machine
from bench.datasets import BenchTokenizer, DatasetSpec, SampleRequest, build_dataset
from bench.datasets.prompts_file import load_prompts
from bench.launched import LoomServer
from bench.metrics import Distribution, HistogramView, RequestRecord, histogram_view
from bench.run_result import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, ServeConfig
from bench.serve import (
    STREAM_READ_TIMEOUT_S,
    _warm_up,
    default_tokenizer_dir,
    fetch_metrics,
    request_body,
    served_model,
    stream_one,
)

POLL_S = 0.02


@dataclass(slots=True)
class BurstConfig:
    concurrency: int = 32
    burst_size: int = 20
    prompt_chars: int = 100_000
    burst_delay_s: float = 3.0  # after all C streams have produced a token
    duration_s: float = 10.0  # the measured window, from the burst on

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.burst_size < 0 or self.prompt_chars < 1:
            raise ValueError("concurrency and prompt chars must be positive, burst size >= 0")
        if self.burst_delay_s < 0 or self.duration_s <= 0:
            raise ValueError("burst delay must be >= 0 and duration positive")


@dataclass(slots=True)
class BurstOutcome:
    status: int | None  # None: no HTTP answer
    latency_s: float  # request sent -> whole answer read
    error: dict[str, Any] | None = None  # the answer's OpenAI `error` object
    failure: str | None = None  # transport failure


@dataclass(slots=True)
class BurstRun:
    label: str
    burst_fired: bool
    window_s: float
    steady_completed: int
    steady_failed: int
    steady_errors: dict[str, int]
    ramp_s: float  # load start -> all C streams producing tokens
    itl_ms: Distribution  # gaps ending inside the window
    itl_gaps: int
    step_time: HistogramView | None  # None: the server has no loom:step_time_seconds
    burst: list[BurstOutcome] = field(default_factory=list)

    @property
    def statuses(self) -> dict[str, int]:
        return dict(Counter(str(outcome.status) for outcome in self.burst))

    @property
    def burst_latency_ms(self) -> Distribution:
        return Distribution.of_seconds([outcome.latency_s for outcome in self.burst])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "step_time": self.step_time.to_dict() if self.step_time else None,
            "burst_statuses": self.statuses,
            "burst_latency_ms": asdict(self.burst_latency_ms),
        }


def steady_samples(tokenizer: BenchTokenizer, chat: bool, input_len: int, output_len: int,
                   num_prompts: int, seed: int) -> list[SampleRequest]:
    spec = DatasetSpec(name="prompts", num_prompts=num_prompts, input_len=input_len,
                       output_len=output_len, chat=chat, seed=seed)
    return build_dataset(spec, tokenizer)


def burst_prompts(count: int, chars: int, prompts_file: Path) -> list[str]:
    """Distinct prompts of exactly `chars` characters, made of the prompts file's texts."""
    texts = itertools.cycle(record.prompt for record in load_prompts(prompts_file))
    pieces: list[str] = []
    while sum(map(len, pieces)) < chars:
        pieces.append(next(texts))
    body = "\n\n".join(pieces)
    return [(f"Request {index}.\n\n{body}")[:chars] for index in range(count)]


def first_round_len(worker: int, concurrency: int, output_len: int) -> int:
    """max_tokens of a client's first request, staggered so the clients' requests end (and
    their successors' prefills start) spread over time, as in a steady state, not in waves."""
    return max(1, output_len * (worker + 1) // concurrency)


async def steady_client(worker: int, session: aiohttp.ClientSession, url: str,
                        requests: Iterator[SampleRequest], records: list[RequestRecord],
                        model: str, serve: ServeConfig, concurrency: int,
                        stop: asyncio.Event) -> None:
    first = True
    while not stop.is_set():
        sample = next(requests)
        if first:
            sample = replace(sample, output_len=first_round_len(worker, concurrency,
                                                                 sample.output_len))
            first = False
        record = RequestRecord(sample.prompt_len, sample.output_len)
        records.append(record)
        await stream_one(session, url, request_body(sample, model, serve), record, serve.chat)
        if not record.success:
            return  # a failing server would otherwise be hammered in a tight loop


async def send_burst_one(session: aiohttp.ClientSession, url: str,
                         body: dict[str, Any]) -> BurstOutcome:
    start = time.perf_counter()
    try:
        async with session.post(url, json=body) as response:
            raw = await response.read()
            status = response.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        return BurstOutcome(None, time.perf_counter() - start,
                            failure=f"{type(exc).__name__}: {exc}")
    latency = time.perf_counter() - start
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = None
    error = payload.get("error") if isinstance(payload, dict) else None
    return BurstOutcome(status, latency, error if isinstance(error, dict) else None)


async def wait_until_streaming(records: list[RequestRecord], concurrency: int) -> None:
    """Until each client's first request has produced a token (or ended)."""
    while len(records) < concurrency or not all(
            record.chunk_times or record.end for record in records[:concurrency]):
        await asyncio.sleep(POLL_S)


def window_itls(records: list[RequestRecord], start: float, end: float) -> list[float]:
    """Inter-token gaps of every stream whose later chunk arrived inside [start, end]."""
    return [gap for record in records
            for arrival, gap in zip(record.chunk_times[1:], record.itls, strict=True)
            if start <= arrival <= end]


def steady_errors(records: list[RequestRecord]) -> dict[str, int]:
    return dict(Counter(record.error or "unknown" for record in records if not record.success))


async def run_once(label: str, serve: ServeConfig, config: BurstConfig,
                   samples: list[SampleRequest], burst: list[str]) -> BurstRun:
    """One steady run; `burst` prompts (none: no burst) fired at the window's start."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=STREAM_READ_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        model = serve.model or await served_model(session, serve.base_url)
        url = serve.base_url + serve.endpoint
        await _warm_up(session, url, model, serve)
        records: list[RequestRecord] = []
        requests = itertools.cycle(samples)
        stop = asyncio.Event()
        origin = time.perf_counter()
        clients = [asyncio.create_task(steady_client(worker, session, url, requests, records,
                                                     model, serve, config.concurrency, stop))
                   for worker in range(config.concurrency)]
        await wait_until_streaming(records, config.concurrency)
        ramp_s = time.perf_counter() - origin
        await asyncio.sleep(config.burst_delay_s)
        before = await fetch_metrics(session, serve.base_url)
        window_start = time.perf_counter()
        burst_tasks = [asyncio.create_task(send_burst_one(
            session, url, request_body(SampleRequest(prompt, 0, samples[0].output_len), model,
                                       serve))) for prompt in burst]
        await asyncio.sleep(window_start + config.duration_s - time.perf_counter())
        window_end = time.perf_counter()
        after = await fetch_metrics(session, serve.base_url)
        stop.set()
        await asyncio.gather(*clients)
        outcomes = list(await asyncio.gather(*burst_tasks))
    itls = window_itls(records, window_start, window_end)
    done = sum(record.success for record in records)
    return BurstRun(
        label=label, burst_fired=bool(burst), window_s=window_end - window_start,
        steady_completed=done, steady_failed=len(records) - done,
        steady_errors=steady_errors(records), ramp_s=ramp_s,
        itl_ms=Distribution.of_seconds(itls), itl_gaps=len(itls),
        step_time=histogram_view(before, after) if before and after else None,
        burst=outcomes)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def markdown_table(runs: list[BurstRun]) -> str:
    lines = [
        "| run | steady streams ok / failed | ITL p50 ms | ITL p99 ms | ITL max ms | gaps "
        "| steps | step p50 ms | step p99 ms | burst answers | burst latency p50 / max ms |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|",
    ]
    for run in runs:
        step, burst = run.step_time, run.burst_latency_ms
        answers = ", ".join(f"{count} x {status}" for status, count in run.statuses.items())
        lines.append(
            f"| {run.label} | {run.steady_completed} / {run.steady_failed} "
            f"| {_ms(run.itl_ms.median)} | {_ms(run.itl_ms.p99)} | {_ms(run.itl_ms.max)} "
            f"| {run.itl_gaps} | {step.count if step else 'n/a'} "
            f"| {_ms(step.p50_ms if step else None)} | {_ms(step.p99_ms if step else None)} "
            f"| {answers or '-'} "
            f"| {f'{_ms(burst.median)} / {_ms(burst.max)}' if run.burst else '-'} |")
    return "\n".join(lines)


def report(runs: list[BurstRun], args: argparse.Namespace, argv: list[str],
           samples: list[SampleRequest]) -> str:
    prompt_lens = sorted(sample.prompt_len for sample in samples)
    servers = f"both on {args.base_url}" if args.base_url else "each on a fresh server"
    return (
        f"Date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}  \n"
        f"Machine: {machine()}  \n"
        f"Command: `python -m bench.burst {shlex.join(argv)}`  \n"
        f"Workload: {args.concurrency} streaming clients on {args.endpoint}, prompts of "
        f"{prompt_lens[0]}-{prompt_lens[-1]} tokens, {args.output_len} output tokens forced; "
        f"burst of {args.burst_size} x {args.prompt_chars:,}-character prompts "
        f"{args.burst_delay:g} s after all streams produced a token; window: burst to "
        f"+{args.duration:g} s; runs {servers}\n\n"
        f"{markdown_table(runs)}\n")


@contextmanager
def server_for_run(args: argparse.Namespace) -> Iterator[str]:
    if args.base_url:
        yield args.base_url
        return
    launch_args = [*(["--model", args.model] if args.model else []),
                   *shlex.split(args.launch_args)]
    print(f"[burst] starting launch.py {shlex.join(launch_args)}", file=sys.stderr, flush=True)
    with LoomServer(launch_args, log_dir=args.log_dir) as server:
        yield server.base_url


def run_both(args: argparse.Namespace, config: BurstConfig,
             samples: list[SampleRequest]) -> list[BurstRun]:
    burst = burst_prompts(config.burst_size, config.prompt_chars, args.prompts_file)
    runs = []
    for label, prompts in (("steady", []), (f"steady + burst of {config.burst_size}", burst)):
        with server_for_run(args) as base_url:
            serve = ServeConfig(base_url=base_url, endpoint=args.endpoint, ignore_eos=True,
                                progress=False, seed=args.seed)
            run = asyncio.run(run_once(label, serve, config, samples, prompts))
        print(f"[burst] {label}: ITL p99 {_ms(run.itl_ms.p99)} ms, step p99 "
              f"{_ms(run.step_time.p99_ms if run.step_time else None)} ms",
              file=sys.stderr, flush=True)
        if run.burst and (run.burst_latency_ms.max or 0.0) > config.duration_s * 1000.0:
            print(f"[burst] warning: the burst outlasted the {config.duration_s:g} s window; "
                  "raise --duration", file=sys.stderr, flush=True)
        runs.append(run)
    return runs


def parse_args(argv: list[str]) -> argparse.Namespace:
    from bench.datasets import DEFAULT_PROMPTS_FILE

    parser = argparse.ArgumentParser(prog="python -m bench.burst",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None,
                        help="model directory for the Loom servers bench.burst starts "
                             "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--base-url", default=None,
                        help="an already running server to use for both runs instead")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory (default: --model, else the default model)")
    parser.add_argument("--launch-args", default="",
                        help='extra launch.py flags, one string (--launch-args="--dtype '
                             'float32")')
    parser.add_argument("--endpoint", default=CHAT_ENDPOINT,
                        choices=[CHAT_ENDPOINT, COMPLETIONS_ENDPOINT])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--burst-size", type=int, default=20)
    parser.add_argument("--prompt-chars", type=int, default=100_000,
                        help="characters in each burst prompt")
    parser.add_argument("--input-len", type=int, default=100,
                        help="steady prompts: the prompts file's nearest this many tokens")
    parser.add_argument("--num-prompts", type=int, default=64,
                        help="distinct steady prompts, cycled")
    parser.add_argument("--output-len", type=int, default=128,
                        help="steady max_tokens, forced with ignore_eos")
    parser.add_argument("--burst-delay", type=float, default=3.0,
                        help="seconds after all steady streams produced a token")
    parser.add_argument("--duration", type=float, default=10.0,
                        help="seconds measured from the burst (the same window in both runs)")
    parser.add_argument("--prompts-file", type=Path, default=DEFAULT_PROMPTS_FILE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-json", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="launch.py logs (default: a temporary directory)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    config = BurstConfig(args.concurrency, args.burst_size, args.prompt_chars,
                         args.burst_delay, args.duration)
    tokenizer = BenchTokenizer.load(args.tokenizer or default_tokenizer_dir(args.model))
    samples = steady_samples(tokenizer, args.endpoint == CHAT_ENDPOINT, args.input_len,
                             args.output_len, args.num_prompts, args.seed)
    runs = run_both(args, config, samples)
    print(report(runs, args, argv, samples))
    if args.save_json:
        args.save_json.parent.mkdir(parents=True, exist_ok=True)
        args.save_json.write_text(json.dumps([run.to_dict() for run in runs], indent=1))
    return 1 if any(run.steady_failed for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
