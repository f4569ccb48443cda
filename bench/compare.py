"""One workload against Loom in several batching modes, and any other server, in one table.

    python -m bench.compare [--model DIR] [--modes continuous,static,seqs1]
        [--concurrency 1,8,32,64] [--url [NAME=]URL ...] [--peer NAME='COMMAND {port}' ...]
        [--launch-args "--dtype float32"]
        [workload and request flags of bench.serve] [--output FILE] [--plot DIR]
        [--save-json FILE] [--rounds N]

The defaults are workload W1: 64 chat prompts of about 100 tokens from the project's
prompts file, 128 output tokens forced with ignore_eos. Modes: `continuous`, `static`
(--batching static) and `seqs1` (--max-num-seqs 1). Each (mode, concurrency) runs on a
freshly started server, so no run finds the previous run's prompts in the prefix cache;
--reuse-server keeps one server per mode. `--peer` servers are started the same way, fresh
per cell, from their command line; `--url` targets are used as they are. `--rounds N` runs
every cell N times, the targets' order rotated each round (each target goes first, second...
alike, so a machine that drifts weighs on all of them), and adds a table of the medians and
each target's ratio to the first target's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from statistics import median

from bench.datasets import BenchTokenizer, SampleRequest, build_dataset
from bench.launched import LoomServer
from bench.peer import PeerServer
from bench.run_result import CHAT_ENDPOINT, RunResult
from bench.serve import (
    add_request_args,
    add_workload_args,
    dataset_spec,
    run_benchmark,
    serve_config,
)

MODES: dict[str, list[str]] = {
    "continuous": ["--batching", "continuous"],
    "static": ["--batching", "static"],
    "seqs1": ["--max-num-seqs", "1"],
}
W1_DEFAULTS = {"dataset": "prompts", "num_prompts": 64, "input_len": 100, "output_len": 128,
               "ignore_eos": True, "endpoint": CHAT_ENDPOINT}


@dataclass(slots=True)
class Target:
    name: str
    base_url: str | None = None  # None: compare starts it (launch.py or the peer command)
    launch_args: list[str] = field(default_factory=list)
    peer_command: str | None = None  # a peer server's command line, "{port}" filled in


@dataclass(slots=True)
class Run:
    target: str
    concurrency: int
    result: RunResult
    round: int = 0


def parse_targets(args: argparse.Namespace) -> list[Target]:
    targets = []
    model_args = ["--model", args.model] if args.model else []
    for mode in filter(None, args.modes.split(",")):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        targets.append(Target(f"loom {mode}", None,
                              [*model_args, *MODES[mode], *shlex.split(args.launch_args)]))
    for index, spec in enumerate(args.url):
        name, _, url = spec.partition("=") if "=" in spec.split("://")[0] else ("", "", spec)
        targets.append(Target(name or f"url{index + 1} {url}", url))
    for index, spec in enumerate(args.peer):
        name, separator, command = spec.partition("=")
        if not separator or " " in name:
            name, command = f"peer{index + 1}", spec
        targets.append(Target(name, peer_command=command))
    return targets


@contextmanager
def served(target: Target, log_dir: Path) -> Iterator[str]:
    """The target's base URL, with a Loom server running behind it when compare starts one."""
    if target.base_url is not None:
        yield target.base_url
        return
    if target.peer_command is not None:
        print(f"[compare] starting {target.name}: {target.peer_command}", file=sys.stderr,
              flush=True)
        with PeerServer(command=target.peer_command, log_dir=log_dir) as peer:
            yield peer.base_url
        return
    print(f"[compare] starting {target.name}: launch.py {shlex.join(target.launch_args)}",
          file=sys.stderr, flush=True)
    with LoomServer(target.launch_args, log_dir=log_dir) as server:
        yield server.base_url


def run_target(target: Target, levels: list[int], args: argparse.Namespace,
               samples: list[SampleRequest], tokenizer: BenchTokenizer,
               log_dir: Path) -> list[Run]:
    runs = []
    shared = served(target, log_dir) if args.reuse_server else nullcontext(None)
    with shared as shared_url:
        for concurrency in levels:
            own = served(target, log_dir) if shared_url is None else nullcontext(shared_url)
            with own as base_url:
                config = serve_config(args, base_url, None, concurrency)
                result = asyncio.run(run_benchmark(config, dataset_spec(args), samples,
                                                   tokenizer))
            metrics = result.metrics
            print(f"[compare] {target.name} c={concurrency}: {metrics.completed} ok, "
                  f"{metrics.failed} failed, {metrics.output_throughput:.1f} output tok/s",
                  file=sys.stderr, flush=True)
            runs.append(Run(target.name, concurrency, result))
    return runs


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def markdown_table(runs: list[Run]) -> str:
    lines = [
        "| target | concurrency | round | ok / failed | duration s | req/s | output tok/s "
        "| total tok/s | TTFT p50 ms | TTFT mean ms | TTFT p99 ms | TPOT mean ms | TPOT p99 ms "
        "| ITL p50 ms | ITL p99 ms | E2E p50 ms | step p99 ms |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for run in runs:
        m, step = run.result.metrics, run.result.step_time
        lines.append(
            f"| {run.target} | {run.concurrency} | {run.round + 1} | {m.completed} / {m.failed} "
            f"| {m.duration_s:.1f} | {m.request_throughput:.2f} | {m.output_throughput:.1f} "
            f"| {m.total_token_throughput:.1f} | {_ms(m.ttft_ms.median)} | {_ms(m.ttft_ms.mean)} "
            f"| {_ms(m.ttft_ms.p99)} | {_ms(m.tpot_ms.mean)} | {_ms(m.tpot_ms.p99)} "
            f"| {_ms(m.itl_ms.median)} | {_ms(m.itl_ms.p99)} "
            f"| {_ms(m.e2el_ms.median)} | {_ms(step.p99_ms if step else None)} |")
    return "\n".join(lines)


def medians_table(runs: list[Run]) -> str:
    """Per target and concurrency: each round's output tok/s, their median, its ratio to the
    first target's median at that concurrency, and the medians of total tok/s and TTFT p50."""
    cells: dict[tuple[str, int], list[Run]] = {}
    for run in runs:
        cells.setdefault((run.target, run.concurrency), []).append(run)
    first_target = runs[0].target
    lines = ["| target | concurrency | output tok/s by round | median | / " + first_target
             + " | total tok/s (median) | TTFT p50 ms (median) |",
             "|---|--:|---|--:|--:|--:|--:|"]
    for (target, concurrency), cell in cells.items():
        cell.sort(key=lambda run: run.round)
        speeds = [run.result.metrics.output_throughput for run in cell]
        totals = [run.result.metrics.total_token_throughput for run in cell]
        ttfts = [t for run in cell if (t := run.result.metrics.ttft_ms.median) is not None]
        reference = [run.result.metrics.output_throughput
                     for run in cells.get((first_target, concurrency), [])]
        ratio = f"{median(speeds) / median(reference):.3f}" if reference else "n/a"
        lines.append(
            f"| {target} | {concurrency} | {' '.join(f'{speed:.1f}' for speed in speeds)} "
            f"| {median(speeds):.1f} | {ratio} | {median(totals):.1f} "
            f"| {_ms(median(ttfts) if ttfts else None)} |")
    return "\n".join(lines)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next(line.split(":", 1)[1].strip() for line in cpuinfo
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, " \
           f"Python {platform.python_version()}"


def report(runs: list[Run], args: argparse.Namespace, argv: list[str],
           samples: list[SampleRequest]) -> str:
    prompt_lens = sorted(sample.prompt_len for sample in samples)
    step_note = "" if any(run.result.step_time for run in runs) else \
        "\nStep time: not available (the servers expose no loom:step_time_seconds).\n"
    return (
        f"Date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}  \n"
        f"Machine: {machine()}  \n"
        f"Command: `python -m bench.compare {shlex.join(argv)}`  \n"
        f"Workload: {len(samples)} requests, dataset {args.dataset}, {args.endpoint}, prompt "
        f"tokens {prompt_lens[0]}-{prompt_lens[-1]} (median "
        f"{prompt_lens[len(prompt_lens) // 2]}), max_tokens {args.output_len}"
        f"{' forced (ignore_eos)' if args.ignore_eos else ''}, request rate "
        f"{args.request_rate:g}/s, temperature {args.temperature:g}\n\n"
        f"{markdown_table(runs)}\n{step_note}"
        + (f"\nMedians over {args.rounds} rounds (the targets' order rotated each round):\n\n"
           f"{medians_table(runs)}\n" if args.rounds > 1 else ""))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.compare",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None,
                        help="model directory for the Loom servers (default: the embedded "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory (default: the --model directory)")
    parser.add_argument("--modes", default="continuous,static,seqs1",
                        help=f"comma-separated Loom modes among {', '.join(MODES)}; "
                             "empty for none")
    parser.add_argument("--concurrency", default="1,8,32,64",
                        help="comma-separated --max-concurrency levels")
    parser.add_argument("--url", action="append", default=[], metavar="[NAME=]URL",
                        help="an extra OpenAI-compatible server to run the workload against")
    parser.add_argument("--peer", action="append", default=[], metavar="NAME=COMMAND",
                        help="another server to start fresh for every cell from COMMAND, "
                             "whose {port} compare fills in (e.g. vllm='python -m "
                             "vllm.entrypoints.openai.api_server ... --port {port}'); "
                             "ready when GET /v1/models answers")
    parser.add_argument("--launch-args", default="",
                        help='extra launch.py flags for every Loom server, one string '
                             '(write --launch-args="--dtype float32")')
    parser.add_argument("--reuse-server", action="store_true",
                        help="one Loom server per mode for all concurrency levels")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every cell this many times, the targets' order rotated "
                             "each round, and report the medians")
    parser.add_argument("--output", type=Path, default=None, help="write the markdown here")
    parser.add_argument("--save-json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, metavar="DIR")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="launch.py logs (default: a temporary directory)")
    add_workload_args(parser)
    add_request_args(parser)
    parser.set_defaults(**W1_DEFAULTS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    from common.default_model import resolve_model

    model_dir = resolve_model(args.model, progress=lambda text: print(text, file=sys.stderr))
    args.model = model_dir
    tokenizer = BenchTokenizer.load(args.tokenizer or model_dir)
    samples = build_dataset(dataset_spec(args), tokenizer)
    levels = [int(level) for level in args.concurrency.split(",") if level]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="loom-compare-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    targets = parse_targets(args)
    runs: list[Run] = []
    for round_index in range(args.rounds):
        shift = round_index % len(targets) if targets else 0
        for target in targets[shift:] + targets[:shift]:
            for run in run_target(target, levels, args, samples, tokenizer, log_dir):
                run.round = round_index
                runs.append(run)
    position = {target.name: index for index, target in enumerate(targets)}
    runs.sort(key=lambda run: position[run.target])  # stable: rounds stay in order
    text = report(runs, args, argv, samples)
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
    if args.save_json:
        args.save_json.parent.mkdir(parents=True, exist_ok=True)
        args.save_json.write_text(json.dumps(
            [{"target": run.target, "concurrency": run.concurrency, "round": run.round,
              **run.result.to_dict()}
             for run in runs], indent=1))
    if args.plot:
        from bench.plots import plot_comparison

        for path in plot_comparison([(r.target, r.concurrency, r.result) for r in runs],
                                    args.plot):
            print(f"wrote {path}", file=sys.stderr)
    failed = sum(run.result.metrics.failed for run in runs)
    return 1 if failed or not runs else 0


if __name__ == "__main__":
    sys.exit(main())
