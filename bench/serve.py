"""Serving benchmark: stream requests at an OpenAI-compatible server, report latency and throughput.

    python -m bench.serve --base-url http://127.0.0.1:8000 [--endpoint /v1/chat/completions]
        [--model NAME] [--tokenizer DIR] --num-prompts N [--request-rate R|inf]
        [--burstiness B] [--max-concurrency C] --dataset random|prompts|shared-prefix
        [--input-len I --output-len O --range-ratio X] [--ignore-eos] [--seed S]
        [--slo ttft=MS,tpot=MS] [--save-json F] [--plot DIR]

Arrivals are a gamma process of mean rate R (burstiness 1 is Poisson; lower is burstier).
Output tokens are counted by re-encoding each answer with the model's tokenizer, after the
run so the counting never delays a stream; the server's `usage` counts are kept beside.
Against Loom the report adds the server's `/metrics` counters and step-time histogram when
the server exposes them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp

from bench.datasets import (
    DATASETS,
    DEFAULT_PROMPTS_FILE,
    BenchTokenizer,
    DatasetSpec,
    SampleRequest,
    build_dataset,
    chat_messages,
    write_prompts,
)
from bench.metrics import (
    PrometheusSnapshot,
    RequestRecord,
    Slo,
    compute_metrics,
    histogram_view,
    parse_prometheus,
    server_counters,
)
from bench.run_result import (
    CHAT_ENDPOINT,
    COMPLETIONS_ENDPOINT,
    RunResult,
    ServeConfig,
)

WARMUP_PROMPT = "Say hello."
STREAM_READ_TIMEOUT_S = 600.0


def request_body(sample: SampleRequest, model: str, config: ServeConfig) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": sample.output_len,
        "temperature": config.temperature,
        "stream": True,
    }
    if config.include_usage:
        body["stream_options"] = {"include_usage": True}
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.chat:
        body["messages"] = chat_messages(sample.prompt, sample.system)
    else:
        body["prompt"] = sample.prompt
    return body | config.extra_body


async def stream_one(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                     record: RequestRecord, chat: bool) -> None:
    """Send one streaming request; fills `record` and never raises for a failed request."""
    record.start = time.perf_counter()
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {_error_message(await response.text())}"
                return
            finished = await _read_events(response, record, chat)
            record.end = time.perf_counter()
            if record.error is None and not finished:
                record.error = "stream ended without [DONE]"
            record.success = record.error is None
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        if not record.end:
            record.end = time.perf_counter()


async def _read_events(response: aiohttp.ClientResponse, record: RequestRecord,
                       chat: bool) -> bool:
    """True when the stream ended with [DONE]."""
    async for line in response.content:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        now = time.perf_counter()
        chunk = json.loads(data)
        if "error" in chunk:
            record.error = f"stream error: {_error_message(chunk)}"
            continue
        for choice in chunk.get("choices") or ():
            text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if text:
                record.chunk_times.append(now)
                record.texts.append(text)
        usage = chunk.get("usage")
        if usage:
            record.usage_prompt_tokens = usage.get("prompt_tokens")
            record.usage_output_tokens = usage.get("completion_tokens")
    return False


def _error_message(payload: str | dict[str, Any]) -> str:
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except ValueError:
            return payload[:200]
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])[:200]
    return json.dumps(payload)[:200]


def arrival_offsets(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent; a gamma process of mean rate."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    offsets, now = [], 0.0
    for index in range(count):
        if index:
            now += rng.gammavariate(burstiness, theta)
        offsets.append(now)
    return offsets


class ProgressBar:
    """One stderr line, redrawn at most ten times a second (every 10% when not a terminal)."""

    WIDTH = 30

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self.enabled = enabled
        self.interactive = sys.stderr.isatty()
        self.started = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1

    def advance(self, success: bool) -> None:
        self.done += 1
        self.failed += not success
        now = time.perf_counter()
        decile = self.done * 10 // self.total
        if self.interactive and (now - self._last_draw >= 0.1 or self.done == self.total):
            self._draw("\r", "")
            self._last_draw = now
        elif not self.interactive and decile != self._last_decile:
            self._draw("", "\n")
        self._last_decile = decile

    def close(self) -> None:
        if self.enabled and self.interactive:
            sys.stderr.write("\n")

    def _draw(self, head: str, tail: str) -> None:
        if not self.enabled:
            return
        filled = self.WIDTH * self.done // self.total
        bar = "#" * filled + "." * (self.WIDTH - filled)
        elapsed = time.perf_counter() - self.started
        sys.stderr.write(f"{head}[{bar}] {self.done}/{self.total} requests, {self.failed} "
                         f"failed, {elapsed:.1f} s{tail}")
        sys.stderr.flush()


async def fetch_metrics(session: aiohttp.ClientSession, base_url: str
                        ) -> PrometheusSnapshot | None:
    try:
        async with session.get(f"{base_url}/metrics") as response:
            if response.status != 200:
                return None
            return parse_prometheus(await response.text())
    except aiohttp.ClientError:
        return None


async def served_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models") as response:
        response.raise_for_status()
        models = (await response.json())["data"]
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return models[0]["id"]


async def run_benchmark(config: ServeConfig, spec: DatasetSpec, samples: list[SampleRequest],
                        tokenizer: BenchTokenizer) -> RunResult:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=STREAM_READ_TIMEOUT_S)
    # A connection per request: llama-server drops reused keep-alive connections now and
    # then, and a local connect costs well under a millisecond beside a streamed answer.
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = config.model or await served_model(session, config.base_url)
        url = config.base_url + config.endpoint
        if config.warmup:
            await _warm_up(session, url, model, config)
        before = await fetch_metrics(session, config.base_url)
        records = [RequestRecord(sample.prompt_len, sample.output_len) for sample in samples]
        progress = ProgressBar(len(samples), config.progress)
        limit = (asyncio.Semaphore(config.max_concurrency) if config.max_concurrency
                 else contextlib.nullcontext())

        async def send(sample: SampleRequest, record: RequestRecord) -> None:
            async with limit:
                await stream_one(session, url, request_body(sample, model, config), record,
                                 config.chat)
            progress.advance(record.success)

        origin = time.perf_counter()
        tasks = []
        offsets = arrival_offsets(len(samples), config.request_rate, config.burstiness,
                                  config.seed)
        for sample, record, offset in zip(samples, records, offsets, strict=True):
            delay = origin + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(sample, record)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - origin
        progress.close()
        after = await fetch_metrics(session, config.base_url)
    accounting_started = time.perf_counter()
    for record in records:
        if record.success:
            record.output_tokens = tokenizer.count(record.output_text)
    accounting_s = time.perf_counter() - accounting_started
    return RunResult(
        config=config,
        dataset=spec,
        metrics=compute_metrics(records, duration, config.slo),
        records=records,
        origin=origin,
        server=server_counters(before or PrometheusSnapshot({}, {}), after) if after else None,
        step_time=histogram_view(before, after) if after else None,
        accounting_s=accounting_s,
    )


async def _warm_up(session: aiohttp.ClientSession, url: str, model: str,
                   config: ServeConfig) -> None:
    warmup = SampleRequest(WARMUP_PROMPT, 0, 4)
    record = RequestRecord(0, 4)
    body = request_body(warmup, model, config) | {"ignore_eos": False}
    await stream_one(session, url, body, record, config.chat)
    if not record.success:
        raise RuntimeError(f"warm-up request to {url} failed: {record.error}")


def format_report(result: RunResult) -> str:
    m = result.metrics
    lines = [_title("Serving Benchmark Result")]

    def row(label: str, value: Any, digits: int = 2) -> None:
        text = "n/a" if value is None else f"{value:.{digits}f}" if isinstance(value, float) \
            else str(value)
        lines.append(f"{label:<42}{text:>10}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    if m.failed:
        lines.extend(f"  {count} x {error}" for error, count in result.errors().items())
    row("Maximum request concurrency:", result.config.max_concurrency)
    row("Benchmark duration (s):", m.duration_s)
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens (tokenizer):", m.total_output_tokens)
    row("Total generated tokens (server usage):", m.total_output_tokens_usage)
    row("Requests whose two counts differ:", m.output_token_mismatches)
    row("Request throughput (req/s):", m.request_throughput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Total token throughput (tok/s):", m.total_token_throughput)
    if m.slo is not None:
        row(f"Goodput (req/s) [{_slo_text(m.slo)}]:", m.goodput_request_throughput)
    for title, name, dist in (("Time to First Token", "TTFT", m.ttft_ms),
                              ("Time per Output Token (excl. 1st token)", "TPOT", m.tpot_ms),
                              ("Inter-token Latency", "ITL", m.itl_ms),
                              ("End-to-end Latency", "E2EL", m.e2el_ms)):
        lines.append(_title(title, "-"))
        for stat in ("mean", "median", "p90", "p99", "max"):
            row(f"{stat.capitalize()} {name} (ms):", getattr(dist, stat))
    lines.append(_title("Engine step time (server)", "-"))
    if result.step_time is None:
        lines.append("not available (no loom:step_time_seconds histogram at /metrics)")
    else:
        view = result.step_time
        row("Steps:", view.count)
        for stat in ("mean", "p50", "p90", "p99"):
            row(f"{stat.capitalize()} step time (ms):", getattr(view, f"{stat}_ms"))
    lines.append(_title("Server counters", "-"))
    if result.server is None:
        lines.append("not available (no /metrics)")
    else:
        for key, value in result.server["counters"].items():
            lines.append(f"{key:<60} +{value:g}")
    lines.append("=" * 52)
    return "\n".join(lines)


def _title(text: str, fill: str = "=") -> str:
    return f" {text} ".center(52, fill)


def _slo_text(slo: Slo) -> str:
    return ", ".join(f"{name}<={limit:g}ms" for name, limit in asdict(slo).items()
                     if limit is not None)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Which requests are sent: shared by bench.serve and bench.compare."""
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset", default="random", choices=sorted(DATASETS))
    group.add_argument("--num-prompts", type=int, default=100)
    group.add_argument("--input-len", type=int, default=None,
                       help="prompt tokens, chat template included (random: default 256; "
                            "prompts: pick the prompts nearest this length; shared-prefix: "
                            "tokens after the prefix, default 64)")
    group.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    group.add_argument("--range-ratio", type=float, default=0.0,
                       help="draw lengths uniformly from len * [1 - X, 1 + X]")
    group.add_argument("--prefix-len", type=int, default=512, help="shared-prefix only")
    group.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix only")
    group.add_argument("--prompts-file", type=Path, default=DEFAULT_PROMPTS_FILE)
    group.add_argument("--seed", type=int, default=0)


def add_request_args(parser: argparse.ArgumentParser) -> None:
    """How requests are sent: shared by bench.serve and bench.compare."""
    group = parser.add_argument_group("requests")
    group.add_argument("--endpoint", default=COMPLETIONS_ENDPOINT,
                       choices=[COMPLETIONS_ENDPOINT, CHAT_ENDPOINT])
    group.add_argument("--request-rate", type=float, default=math.inf,
                       help="mean requests per second (default inf: all at once)")
    group.add_argument("--burstiness", type=float, default=1.0,
                       help="gamma shape of arrival gaps: 1 is Poisson, < 1 burstier")
    group.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=False,
                       help="force --output-len tokens (vLLM's ignore_eos extra field)")
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--extra-body", type=json.loads, default={}, metavar="JSON",
                       help="fields merged into every request body, e.g. "
                            """'{"response_format": {"type": "json_object"}}'""")
    group.add_argument("--no-usage", action="store_true",
                       help="do not ask for stream_options.include_usage")
    group.add_argument("--slo", type=Slo.parse, default=None, metavar="ttft=MS,tpot=MS",
                       help="goodput objectives (ttft, tpot, e2el in milliseconds)")
    group.add_argument("--no-warmup", action="store_true")
    group.add_argument("--no-progress", action="store_true")


def dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    return DatasetSpec(
        name=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.range_ratio, prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes, prompts_file=args.prompts_file,
        chat=args.endpoint == CHAT_ENDPOINT, seed=args.seed)


def serve_config(args: argparse.Namespace, base_url: str, model: str | None,
                 max_concurrency: int | None) -> ServeConfig:
    return ServeConfig(
        base_url=base_url, endpoint=args.endpoint, model=model,
        request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=max_concurrency, ignore_eos=args.ignore_eos,
        temperature=args.temperature, include_usage=not args.no_usage, slo=args.slo,
        warmup=not args.no_warmup, progress=not args.no_progress, seed=args.seed,
        extra_body=args.extra_body)


def default_tokenizer_dir(model: str | None) -> str:
    """The --model value when it is a local directory, else the default model's."""
    if model and (Path(model) / "config.json").is_file():
        return model
    from common.default_model import resolve_model

    return resolve_model(None, progress=lambda message: print(message, file=sys.stderr))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serve",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None,
                        help="model name sent in requests (default: the first of /v1/models)")
    parser.add_argument("--tokenizer", default=None,
                        help="local model directory with the tokenizer (default: --model when "
                             "it is a directory, else the default model's)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--save-json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, metavar="DIR",
                        help="write PNG plots (latency CDFs, throughput, concurrency) here")
    parser.add_argument("--export-prompts", type=Path, default=None, metavar="FILE",
                        help="write the drawn workload as JSON lines (read by --prompts-file "
                             "and by vllm bench serve --dataset-name custom) and exit")
    add_workload_args(parser)
    add_request_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = BenchTokenizer.load(args.tokenizer or default_tokenizer_dir(args.model))
    spec = dataset_spec(args)
    samples = build_dataset(spec, tokenizer)
    if args.export_prompts:
        write_prompts(samples, args.export_prompts, spec.chat)
        print(f"wrote {len(samples)} prompts to {args.export_prompts}", file=sys.stderr)
        return 0
    model = args.model if args.model and not Path(args.model).is_dir() else None
    config = serve_config(args, args.base_url, model, args.max_concurrency)
    result = asyncio.run(run_benchmark(config, spec, samples, tokenizer))
    print(format_report(result))
    if args.save_json:
        args.save_json.parent.mkdir(parents=True, exist_ok=True)
        args.save_json.write_text(json.dumps(result.to_dict(), indent=1))
    if args.plot:
        from bench.plots import plot_run

        for path in plot_run(result, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if result.metrics.completed else 1


if __name__ == "__main__":
    sys.exit(main())
