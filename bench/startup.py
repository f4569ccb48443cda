"""Start-up and single-request figures, measured through launch.py the way a user starts Loom.

    python -m bench.startup [--dtype float32] [--cold] [--output-len 128]
        [--launch-args="--compile"]

Reports time to READY (engine) and to serving (frontend answering /health), single-request
decode tok/s over a streamed completion, and the peak RSS (VmHWM) of each process.
`--cold` points $LOOM_CACHE at a fresh directory so the default model is fetched and
converted first.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from bench.launched import REPO_ROOT, children_by_role, status_kib
from common.sockets import free_port


def peak_rss_mib(pid: int) -> float:
    return (status_kib(pid, "VmHWM") or 0) / 1024


def decode_rate(port: int, output_len: int) -> tuple[float, float]:
    """Streams one completion; returns (decode tok/s after the first token, TTFT seconds)."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "stream": True,
            "max_tokens": output_len, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    token_times = []
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if line.startswith(b"data: {"):
                token_times.append(time.perf_counter())
    ttft = token_times[0] - started
    return (len(token_times) - 1) / (token_times[-1] - token_times[0]), ttft


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.startup")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cold", action="store_true")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--launch-args", default="",
                        help='more launch.py flags, one string (--launch-args="--compile")')
    args = parser.parse_args()
    env = dict(os.environ)
    if args.cold:
        env["LOOM_CACHE"] = tempfile.mkdtemp(prefix="loom-cold-cache-")
    port = free_port()
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "launch.py", "--port", str(port), "--dtype", args.dtype,
         *shlex.split(args.launch_args)],
        cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True)
    engine_ready = serving = None
    for line in process.stderr:
        if "engine ready" in line and engine_ready is None:
            engine_ready = time.perf_counter() - started
        if "serving " in line:
            serving = time.perf_counter() - started
            break
    if serving is None:
        raise SystemExit("launch.py did not come up")
    try:
        decode_rate(port, 8)  # warm-up
        rate, ttft = decode_rate(port, args.output_len)
        rss = {name: peak_rss_mib(pid) for name, pid in children_by_role(process.pid).items()}
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    print(f"dtype {args.dtype}, {'cold' if args.cold else 'warm'} cache, launch.py "
          f"{args.launch_args or '(defaults)'}")
    print(f"engine READY after {engine_ready:.1f} s, serving after {serving:.1f} s")
    print(f"single request: {rate:.1f} decode tok/s over {args.output_len} tokens, "
          f"TTFT {ttft * 1000:.0f} ms")
    print("peak RSS: " + ", ".join(f"{name} {mib:.0f} MiB" for name, mib in rss.items()))


if __name__ == "__main__":
    main()
