"""Issue 32's isolation figure in one command: a light tenant's TTFT beside a flooding tenant,
against the light tenant alone, on fresh servers in one run.

    python -m bench.tenant_isolation [--capacity R] [--duration 30] [--input-len 256]
        [--output-len 64] [--launch-args "--max-num-seqs 32"] [--rounds 1]

1. Capacity C: the heavy tenant alone, offered 16 requests/s (or --capacity R, skipping it):
   C = requests completed / seconds the run took.
2. The light tenant alone at 0.2C, against a server with --tenants.
3. Heavy at 4C and light at 0.2C: FCFS (no --tenants) and with --tenants (weights 1:1).

Each cell starts a fresh server (`launch.py ... --tenants FILE` with keys written for the
run). The report gives the light tenant's TTFT p50 / p99 in each cell and its ratio to alone
(issue 32 asks <= 1.5x with --tenants).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from statistics import median

from bench.compare import machine
from bench.launched import LoomServer
from bench.run_result import COMPLETIONS_ENDPOINT
from bench.tenants import TenantLoad, TenantReport, run_all

HEAVY = "heavy"
LIGHT = "light"
CAPACITY_PROBE_RATE = 16.0


@dataclass(slots=True)
class Cell:
    name: str
    light: TenantReport
    heavy: TenantReport | None = None
    seconds: float = 0.0  # from the first arrival to the last response's end

    @property
    def output_tokens_per_s(self) -> float:
        total = self.light.output_tokens + (self.heavy.output_tokens if self.heavy else 0)
        return total / self.seconds if self.seconds else 0.0


def write_tenants_file(directory: Path) -> Path:
    lines = []
    for name in (HEAVY, LIGHT):
        digest = hashlib.sha256(f"sk-{name}".encode()).hexdigest()
        lines += [f"[tenants.{name}]", f'key_sha256 = "{digest}"', "weight = 1", ""]
    path = directory / "tenants.toml"
    path.write_text("\n".join(lines))
    return path


def run_loads(args: argparse.Namespace, launch_args: list[str],
              loads: list[TenantLoad]) -> tuple[list[TenantReport], float]:
    with LoomServer(launch_args=launch_args, log_dir=args.log_dir) as server:
        namespace = argparse.Namespace(
            base_url=server.base_url, model=None, tenant=loads, duration=args.duration,
            burst=64, input_len=args.input_len, output_len=args.output_len, ignore_eos=True,
            endpoint=COMPLETIONS_ENDPOINT, seed=args.seed, warmup=True)
        return asyncio.run(run_all(namespace))


def measure_capacity(args: argparse.Namespace, launch_args: list[str]) -> float:
    reports, seconds = run_loads(args, launch_args,
                                 [TenantLoad(HEAVY, "sk-heavy", CAPACITY_PROBE_RATE)])
    capacity = reports[0].completed / seconds
    print(f"[tenant_isolation] capacity: {reports[0].completed} requests in {seconds:.1f} s "
          f"= {capacity:.2f} requests/s", file=sys.stderr, flush=True)
    return capacity


def run_round(args: argparse.Namespace, base: list[str], tenants_file: Path,
              capacity: float) -> list[Cell]:
    heavy = TenantLoad(HEAVY, "sk-heavy", 4 * capacity)
    light = TenantLoad(LIGHT, "sk-light", 0.2 * capacity)
    with_tenants = [*base, "--tenants", str(tenants_file)]
    cells = []
    for name, launch_args, loads in (("alone", with_tenants, [light]),
                                     ("beside heavy, FCFS", base, [heavy, light]),
                                     ("beside heavy, --tenants", with_tenants, [heavy, light])):
        print(f"[tenant_isolation] {name}: launch.py {shlex.join(launch_args)}",
              file=sys.stderr, flush=True)
        reports, seconds = run_loads(args, launch_args, loads)
        by_name = {report.name: report for report in reports}
        cells.append(Cell(name, by_name[LIGHT], by_name.get(HEAVY), seconds))
        print(f"[tenant_isolation] {name}: light TTFT p50 {_ms(by_name[LIGHT].ttft_ms.median)} "
              f"p99 {_ms(by_name[LIGHT].ttft_ms.p99)} ms", file=sys.stderr, flush=True)
    return cells


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _ratio(value: float | None, alone: float | None) -> str:
    return "-" if value is None or not alone else f"{value / alone:.2f}x"


def table(rounds: list[list[Cell]]) -> str:
    lines = ["| light tenant (0.2C) | TTFT p50 ms | / alone | TTFT p99 ms | / alone "
             "| light done / refused | heavy done | output tok/s |",
             "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for cells in rounds:
        alone = cells[0].light.ttft_ms
        for cell in cells:
            ttft = cell.light.ttft_ms
            heavy = "-" if cell.heavy is None else str(cell.heavy.completed)
            lines.append(f"| {cell.name} | {_ms(ttft.median)} | {_ratio(ttft.median, alone.median)}"
                         f" | {_ms(ttft.p99)} | {_ratio(ttft.p99, alone.p99)} | "
                         f"{cell.light.completed} / {sum(cell.light.refused.values())} | {heavy} | "
                         f"{cell.output_tokens_per_s:.1f} |")
    return "\n".join(lines)


def medians(rounds: list[list[Cell]]) -> str:
    lines = []
    for index, name in enumerate(cell.name for cell in rounds[0]):
        p50s = [cells[index].light.ttft_ms.median or math.nan for cells in rounds]
        p99s = [cells[index].light.ttft_ms.p99 or math.nan for cells in rounds]
        lines.append(f"{name}: light TTFT p50 median {median(p50s):,.1f} ms, "
                     f"p99 median {median(p99s):,.1f} ms")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.tenant_isolation",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--capacity", type=float, default=None,
                        help="the server's capacity in requests/s (default: measured)")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--launch-args", default="--max-num-seqs 32",
                        help='launch.py flags for every server, one string')
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    base = shlex.split(args.launch_args)
    capacity = args.capacity or measure_capacity(args, base)
    with tempfile.TemporaryDirectory(prefix="loom-tenants-") as directory:
        tenants_file = write_tenants_file(Path(directory))
        rounds = [run_round(args, base, tenants_file, capacity) for _ in range(args.rounds)]
    print(f"Machine: {machine()}  \nCommand: `python -m bench.tenant_isolation "
          f"{shlex.join(argv)}`  \nCapacity C = {capacity:.2f} requests/s; heavy at 4C, "
          f"light at 0.2C, {args.input_len} prompt / {args.output_len} output tokens, "
          f"{args.duration:g} s of arrivals\n\n{table(rounds)}\n\n{medians(rounds)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
