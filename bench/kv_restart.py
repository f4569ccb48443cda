"""Restarts keep prefixes: a long prompt's TTFT on a cold server, then on a server restarted
over the disk tier (`--kv-offload-bytes`) that saw the prompt before, fresh servers the way
a user starts them, one run.

    python -m bench.kv_restart [--prompt-len 4000] [--output-len 16] [--repeats 3]

Each repeat: a cold server without a tier answers the prompt (its prefill is the baseline);
a server with a tier in a fresh directory answers it (writing its blocks) and stops; a
second one over that directory answers it again. Reports TTFT medians, their ratio, and
whether the greedy outputs were identical."""

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
    return LoomServer(args).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=4000)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--offload-bytes", type=int, default=4 * 1024**3)
    options = parser.parse_args()
    cold, warm, same = [], [], []
    for repeat in range(options.repeats):
        rng = random.Random(repeat)
        prompt = [rng.randrange(1000, 40000) for _ in range(options.prompt_len)]
        with served([]) as server:
            seconds, baseline = first_token_and_text(server, prompt, options.output_len)
            cold.append(seconds)
        directory = tempfile.mkdtemp(prefix="loom-kv-")
        tier = ["--kv-offload-dir", directory, "--kv-offload-bytes", str(options.offload_bytes)]
        with served(tier) as server:
            first_token_and_text(server, prompt, options.output_len)
        with served(tier) as server:
            seconds, text = first_token_and_text(server, prompt, options.output_len)
            warm.append(seconds)
        same.append(text == baseline)
        blocks = len(list(Path(directory).rglob("*.kv")))
        print(f"repeat {repeat}: cold {cold[-1]:.2f} s, after restart {warm[-1]:.2f} s, "
              f"{blocks} blocks on disk, same output: {same[-1]}", flush=True)
    print(f"TTFT of a {options.prompt_len}-token prompt, medians of {options.repeats}: cold "
          f"{statistics.median(cold):.2f} s, after a restart {statistics.median(warm):.2f} s "
          f"({statistics.median(warm) / statistics.median(cold):.3f}x); greedy output identical "
          f"every time: {all(same)}")


if __name__ == "__main__":
    main()
