"""Restarts keep prefixes: a long prompt's TTFT on a cold server, then on a server restarted
over the disk tier (`--kv-offload-bytes`) that saw the prompt before, fresh servers the way
a user starts them, one run.

    python -m bench.kv_restart [--prompt-len 4000] [--output-len 16] [--repeats 3]

Each repeat: a cold server without a tier answers the prompt (its prefill is the baseline);
a server with a tier in a fresh directory answers it (writing its blocks), then again (a hit
in its pool), and stops; a second one over that directory answers it (a hit on disk). Every
server first answers a short unrelated prompt, so no TTFT carries a first request's costs.
Reports TTFT medians, their ratio, and whether the answer after the restart is the pool
hit's and the cold prefill's (in bf16 a long prompt's hit may differ from its cold prefill
in the last bits, as any prefix hit may: `--launch-args --batch-invariant` makes them
bitwise equal)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.launched import LoomServer


def first_token_and_text(server: LoomServer, prompt: list[int], output_len: int
                         ) -> tuple[float, str]:
    """Seconds to the first streamed token, and the whole greedy text."""
    body = {"model": model_name(server), "prompt": prompt, "max_tokens": output_len,
            "temperature": 0, "stream": True}
    request = urllib.request.Request(f"{server.base_url}/v1/completions",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    started = time.perf_counter()
    first, text = None, []
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            piece = json.loads(line[6:])["choices"][0]["text"]
            if first is None and piece:
                first = time.perf_counter() - started
            text.append(piece)
    return first or time.perf_counter() - started, "".join(text)


def model_name(server: LoomServer) -> str:
    with urllib.request.urlopen(f"{server.base_url}/v1/models", timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]


def served(args: list[str]) -> LoomServer:
    server = LoomServer(args).start()
    first_token_and_text(server, [100, 200, 300, 400, 500, 600, 700, 800], 2)  # warm up
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=4000)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--offload-bytes", type=int, default=4 * 1024**3)
    parser.add_argument("--launch-args", default="", help="more launch.py flags, one string")
    options = parser.parse_args()
    extra = options.launch_args.split()
    cold, warm, same, same_as_cold = [], [], [], []
    for repeat in range(options.repeats):
        rng = random.Random(repeat)
        prompt = [rng.randrange(1000, 40000) for _ in range(options.prompt_len)]
        with served(extra) as server:
            seconds, baseline = first_token_and_text(server, prompt, options.output_len)
            cold.append(seconds)
        directory = tempfile.mkdtemp(prefix="loom-kv-")
        tier = [*extra, "--kv-offload-dir", directory,
                "--kv-offload-bytes", str(options.offload_bytes)]
        with served(tier) as server:
            first_token_and_text(server, prompt, options.output_len)
            _, pool_hit = first_token_and_text(server, prompt, options.output_len)
        with served(tier) as server:
            seconds, text = first_token_and_text(server, prompt, options.output_len)
            warm.append(seconds)
        same.append(text == pool_hit)
        same_as_cold.append(text == baseline)
        blocks = len(list(Path(directory).rglob("*.kv")))
        print(f"repeat {repeat}: cold {cold[-1]:.2f} s, after restart {warm[-1]:.2f} s, "
              f"{blocks} blocks on disk, answer as the pool hit's: {same[-1]}, as the cold "
              f"prefill's: {same_as_cold[-1]}", flush=True)
    print(f"TTFT of a {options.prompt_len}-token prompt, medians of {options.repeats}: cold "
          f"{statistics.median(cold):.2f} s, after a restart {statistics.median(warm):.2f} s "
          f"({statistics.median(warm) / statistics.median(cold):.3f}x); the answer after the "
          f"restart was the pool hit's {sum(same)}/{len(same)} times, the cold prefill's "
          f"{sum(same_as_cold)}/{len(same)}")


if __name__ == "__main__":
    main()
