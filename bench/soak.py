"""Soak test: streaming clients that hang up at random; nothing lost, no KV block leaked.

    python -m bench.soak [--model DIR|tiny] [--clients 200] [--duration 120]
        [--disconnect-fraction 0.2] [--seed 0] [--json FILE]
    python -m bench.soak --url http://127.0.0.1:8000 [--pids ENGINE,FRONTEND] ...

Without --url it starts Loom through launch.py (`tiny`: a tiny random Llama with the
default model's tokenizer, built on the spot). Each client loops: a chat or completions
stream with a prompt and max_tokens of mixed lengths; a fraction of the streams are cut
off on purpose after a random number of chunks. Outcomes:
- completed: a finish_reason arrived, then [DONE];
- cut: the client hung up on purpose before that;
- rejected: 503 at admission (overload), a clean refusal;
- lost: anything else (an error event, a broken stream, no finish_reason).
At the end, once the server is idle, /metrics must show no KV block in use and no
integrity violation. Exits 1 on any lost request or leaked block. RSS of the engine and
the frontend is sampled throughout and its growth reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.launched import children_by_role, status_kib
from bench.metrics import parse_prometheus

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
WORDS = ("river", "stone", "lamp", "quiet", "orbit", "maple", "signal", "harbor", "velvet",
         "cinder", "meadow", "ledger", "prism", "tundra", "falcon", "copper", "lantern")
# (share of requests, smallest, largest) as fractions of the longest: mixed lengths
LENGTH_MIX = ((0.5, 0.0, 0.05), (0.35, 0.05, 0.33), (0.15, 0.33, 1.0))
IDLE_TIMEOUT_S = 60.0
RSS_SAMPLE_S = 1.0
WARMUP_S = 10.0


@dataclass(slots=True)
class StreamOutcome:
    status: int | None = None  # HTTP status; None: no response at all
    chunks: int = 0  # data events carrying choices
    finish_reason: str | None = None
    done: bool = False  # saw data: [DONE]
    error: str | None = None  # an SSE error event, a non-200 body, or an exception
    cut: bool = False  # the client hung up on purpose
    started: float = 0.0
    ended: float = 0.0

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.finish_reason is not None and self.done

    @property
    def rejected(self) -> bool:
        return self.status == 503 and not self.chunks

    @property
    def kind(self) -> str:
        if self.completed:
            return "completed"
        if self.cut:
            return "cut"
        return "rejected" if self.rejected else "lost"


async def stream_one(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    cut_after_chunks: int | None = None,
    headers: dict[str, str] | None = None,
    outcome: StreamOutcome | None = None,
) -> StreamOutcome:
    """POST a streaming request and read it to the end, or hang up after that many chunks.

    Pass `outcome` to watch it fill while the stream runs."""
    outcome = outcome or StreamOutcome()
    outcome.started = time.monotonic()
    try:
        async with session.post(url, json=body, headers=headers) as response:
            outcome.status = response.status
            if response.status != 200:
                outcome.error = (await response.text())[:500]
                return outcome
            if cut_after_chunks == 0:
                outcome.cut = True
                response.close()
                return outcome
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                payload = line[len(b"data: "):]
                if payload == b"[DONE]":
                    outcome.done = True
                    continue
                event = json.loads(payload)
                if "error" in event:
                    outcome.error = event["error"].get("message", "error event")
                    continue
                for choice in event.get("choices", []):
                    outcome.chunks += 1
                    outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
                if cut_after_chunks is not None and outcome.chunks >= cut_after_chunks \
                        and outcome.finish_reason is None:
                    outcome.cut = True
                    response.close()  # drops the connection: the server sees the client go
                    return outcome
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    finally:
        outcome.ended = time.monotonic()
    return outcome


def pick_length(rng: random.Random, longest: int) -> int:
    share = rng.random()
    for weight, low, high in LENGTH_MIX:
        if share < weight:
            return max(1, round(longest * rng.uniform(low, high)))
        share -= weight
    return longest


def random_request(rng: random.Random, model: str, config: SoakConfig
                   ) -> tuple[str, dict[str, Any]]:
    words = pick_length(rng, config.max_prompt_words)
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    body: dict[str, Any] = {"model": model, "stream": True,
                            "max_tokens": pick_length(rng, config.max_tokens),
                            "temperature": rng.choice([0.0, 0.7, 1.0]), "ignore_eos": True}
    if rng.random() < 0.5:
        return CHAT, body | {"messages": [{"role": "user", "content": text}]}
    return COMPLETIONS, body | {"prompt": text}


@dataclass(slots=True)
class SoakConfig:
    url: str
    clients: int = 200
    duration_s: float = 120.0
    disconnect_fraction: float = 0.2
    seed: int = 0
    api_key: str | None = None
    max_tokens: int = 384  # the longest answers; most are far shorter
    max_prompt_words: int = 800


@dataclass(slots=True)
class Tally:
    completed: int = 0
    cut: int = 0
    rejected: int = 0
    lost: int = 0
    lost_examples: list[str] = field(default_factory=list)

    def add(self, outcome: StreamOutcome) -> None:
        kind = outcome.kind
        setattr(self, kind, getattr(self, kind) + 1)
        if kind == "lost" and len(self.lost_examples) < 10:
            self.lost_examples.append(f"status {outcome.status}, {outcome.chunks} chunks, "
                                      f"finish {outcome.finish_reason}: {outcome.error}")


async def client_loop(worker: int, config: SoakConfig, model: str, deadline: float,
                      session: aiohttp.ClientSession, tally: Tally) -> None:
    rng = random.Random(config.seed * 100_003 + worker)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    while time.monotonic() < deadline:
        path, body = random_request(rng, model, config)
        cut = rng.randint(0, 12) if rng.random() < config.disconnect_fraction else None
        outcome = await stream_one(session, config.url + path, body, cut, headers)
        tally.add(outcome)
        if outcome.rejected:
            await asyncio.sleep(rng.uniform(0.2, 1.0))


# --- the server's side ----------------------------------------------------------------


def rss_bytes(pid: int) -> int | None:
    kib = status_kib(pid, "VmRSS")
    return None if kib is None else kib * 1024


@dataclass(slots=True)
class RssTrack:
    """RSS of one process. Growth counts from the first sample after the warm-up, when
    the allocators have seen full batches; the cold figure is kept beside it."""

    pid: int
    baseline_at: float  # time.monotonic() after which the baseline is taken
    cold: int | None = None
    first: int | None = None
    last: int | None = None
    peak: int = 0

    def sample(self) -> None:
        value = rss_bytes(self.pid)
        if value is None:
            return
        self.cold = value if self.cold is None else self.cold
        if self.first is None and time.monotonic() >= self.baseline_at:
            self.first = value
        self.last = value
        self.peak = max(self.peak, value)

    def summary(self) -> dict[str, float | None]:
        mb = 1024 * 1024

        def megabytes(value: int | None) -> float | None:
            return None if value is None else round(value / mb, 1)

        growth = None if self.first is None or self.last is None else self.last - self.first
        return {"cold_mb": megabytes(self.cold), "start_mb": megabytes(self.first),
                "end_mb": megabytes(self.last), "peak_mb": megabytes(self.peak),
                "growth_mb": megabytes(growth)}


async def sample_rss(tracks: dict[str, RssTrack], stop: asyncio.Event) -> None:
    while not stop.is_set():
        for track in tracks.values():
            track.sample()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), RSS_SAMPLE_S)


async def read_metrics(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    async with session.get(base_url + "/metrics") as response:
        response.raise_for_status()
        return parse_prometheus(await response.text()).samples


async def wait_idle(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """/metrics once the engines run and queue nothing and each that stepped has reported
    going idle (its KV check done)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        samples = await read_metrics(session, base_url)
        if is_at_rest(samples) or time.monotonic() > deadline:
            return samples
        await asyncio.sleep(0.05)


def is_at_rest(samples: dict[str, float]) -> bool:
    reports = [value for key, value in samples.items()
               if key.startswith("loom:engine_at_rest{")]
    return (samples.get("loom:num_requests_running", 1) == 0
            and samples.get("loom:num_requests_waiting", 1) == 0
            and all(value == 1 for value in reports))


async def first_model(session: aiohttp.ClientSession, base_url: str,
                      api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with session.get(base_url + "/v1/models", headers=headers) as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


async def run_soak(config: SoakConfig, pids: dict[str, int]) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = await first_model(session, config.url, config.api_key)
        before = await read_metrics(session, config.url)
        baseline_at = time.monotonic() + min(WARMUP_S, config.duration_s / 4)
        tracks = {name: RssTrack(pid, baseline_at) for name, pid in pids.items()}
        stop_sampling = asyncio.Event()
        sampler = asyncio.create_task(sample_rss(tracks, stop_sampling))
        tally = Tally()
        started = time.monotonic()
        deadline = started + config.duration_s
        await asyncio.gather(*(client_loop(worker, config, model, deadline, session, tally)
                               for worker in range(config.clients)))
        elapsed = time.monotonic() - started
        after = await wait_idle(session, config.url)
        stop_sampling.set()
        await sampler
    violations = (after.get("loom:kv_integrity_violations_total", 0)
                  - before.get("loom:kv_integrity_violations_total", 0))
    kv_usage = after.get("loom:kv_cache_usage_perc", 0.0)
    running = after.get("loom:num_requests_running", 0)
    return {
        "config": asdict(config) | {"api_key": None},
        "elapsed_s": round(elapsed, 1),
        "requests": {"completed": tally.completed, "cut": tally.cut,
                     "rejected": tally.rejected, "lost": tally.lost},
        "lost_examples": tally.lost_examples,
        "leaks": {"kv_integrity_violations": violations, "kv_cache_usage_perc": kv_usage,
                  "num_requests_running": running},
        "leaked": violations > 0 or kv_usage > 0 or running > 0,
        "rss": {name: track.summary() for name, track in tracks.items()},
        "generation_tokens": after.get("loom:generation_tokens_total", 0)
        - before.get("loom:generation_tokens_total", 0),
    }


# --- command line -----------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.soak",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--pids", default=None,
                        help="ENGINE,FRONTEND process ids whose RSS to track (with --url)")
    parser.add_argument("--model", default="tiny",
                        help="model directory to start Loom with, or 'tiny' (without --url)")
    parser.add_argument("--launch-arg", action="append", default=[],
                        help="extra launch.py argument (repeatable), e.g. --launch-arg=--seed=1")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds")
    parser.add_argument("--disconnect-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--max-tokens", type=int, default=384,
                        help="the longest answers (half are under 5%% of it)")
    parser.add_argument("--max-prompt-words", type=int, default=800)
    parser.add_argument("--json", default=None, help="write the report here as JSON")
    return parser.parse_args(argv)


def build_tiny_model() -> str:
    from tests.tiny_server import build_tiny_served_model  # the repository's test toolkit

    return build_tiny_served_model(tempfile.mkdtemp(prefix="loom-soak-model-"))


def print_report(report: dict[str, Any]) -> None:
    requests, leaks = report["requests"], report["leaks"]
    print(f"soak: {report['config']['clients']} clients for {report['elapsed_s']} s, "
          f"{report['generation_tokens']:.0f} tokens generated")
    print(f"  requests: {requests['completed']} completed, {requests['cut']} cut, "
          f"{requests['rejected']} rejected, {requests['lost']} lost")
    for example in report["lost_examples"]:
        print(f"    lost: {example}")
    print(f"  leaks: {leaks['kv_integrity_violations']:.0f} integrity violations, "
          f"KV usage {leaks['kv_cache_usage_perc']:.4f}, "
          f"{leaks['num_requests_running']:.0f} still running at the end")
    for name, rss in report["rss"].items():
        print(f"  {name} RSS: {rss['start_mb']} -> {rss['end_mb']} MB after warm-up "
              f"(cold {rss['cold_mb']}, peak {rss['peak_mb']}, growth {rss['growth_mb']} MB)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = SoakConfig(args.url or "", args.clients, args.duration, args.disconnect_fraction,
                        args.seed, args.api_key, args.max_tokens, args.max_prompt_words)
    server = None
    if args.url is None:
        from bench.launched import LoomServer

        model = build_tiny_model() if args.model == "tiny" else args.model
        server = LoomServer(["--model", model, "--dtype", "float32", *args.launch_arg]).start()
        config.url = server.base_url
        pids = children_by_role(server.process.pid)
    else:
        config.url = args.url.rstrip("/").removesuffix("/v1")
        names = ("engine", "frontend")
        pids = dict(zip(names, map(int, args.pids.split(",")), strict=True)) if args.pids else {}
    try:
        report = asyncio.run(run_soak(config, pids))
    finally:
        if server is not None:
            server.stop()
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 1 if report["requests"]["lost"] or report["leaked"] else 0


if __name__ == "__main__":
    sys.exit(main())
