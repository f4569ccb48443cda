#!/usr/bin/env bash
# The GPU check: ONE script, run from the repository root on a CUDA machine that has torch,
# triton, transformers, aiohttp and msgpack but no network. Prepare on the CPU machine first
# with `bench/gpu_prepare.sh` (wheels and tokenizer files into .whl/). It prints one table:
#   - tests on the GPU: logit parity vs transformers (fp32, bf16), the engine oracle with
#     chunked prefill and forced preemption (tests/test_device_path.py), the Triton kernels
#     compiled natively vs the torch reference (tests/test_triton_attention.py), decode steps
#     replayed from CUDA graphs equal to the eager engine (tests/test_cuda_graphs.py);
#   - random-weight models built from configs (SmolLM2-135M's, a ~1B Llama shape);
#   - W1 offline (bench.offline) and served through launch.py with streaming requests at
#     c=1,64,256 (bench.compare), against transformers' static `generate` at batch 1 and 256.
# Everything lands in $OUT (default /tmp/loom-gpu-check): logs, JSON, table.md.
#
# A dry run on the CPU checks the plumbing with small numbers:
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_MODELS=smollm2 GPU_CHECK_PROMPTS=8 \
#   GPU_CHECK_CONCURRENCY=1,4 GPU_CHECK_OUTPUT_LEN=16 bench/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
MODELS="${GPU_CHECK_MODELS:-smollm2 llama-1b}"
PROMPTS="${GPU_CHECK_PROMPTS:-256}"
CONCURRENCY="${GPU_CHECK_CONCURRENCY:-1,64,256}"
OUTPUT_LEN="${GPU_CHECK_OUTPUT_LEN:-128}"
OUT="${OUT:-/tmp/loom-gpu-check}"
mkdir -p "$OUT"
TABLE="$OUT/table.md"
started=$(date +%s)

if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/loom-site .whl/*.whl \
        >"$OUT/pip.log" 2>&1 || echo "wheel install failed: see $OUT/pip.log"
    export PYTHONPATH="/tmp/loom-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

{
    echo "GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), device $DEVICE"
    "$PY" - <<'PYEOF'
import torch
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"{name}; torch {torch.__version__}, CUDA {torch.version.cuda}")
PYEOF
    echo
    echo "| check | result | seconds | detail |"
    echo "|---|---|--:|---|"
} >"$TABLE"

# row NAME TIMEOUT COMMAND...: runs COMMAND, logs to $OUT/NAME.log, adds a table row whose
# detail is the log's last line that is not blank.
row() {
    local name="$1" limit="$2"
    shift 2
    local log="$OUT/${name// /_}.log" begin=$(date +%s) status
    timeout "$limit" "$@" >"$log" 2>&1
    case $? in 0) status=pass ;; 124) status="TIMEOUT ${limit}s" ;; *) status=FAIL ;; esac
    local detail
    detail="$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | tr '|' '/' | cut -c1-160)"
    echo "| $name | $status | $(($(date +%s) - begin)) | $detail |" >>"$TABLE"
    echo "[gpu_check] $name: $status"
}

# On a GPU the Triton kernels compile natively; on the CPU they go through the interpreter.
NATIVE=0
KERNELS="interpreted"
[ "$DEVICE" = cuda ] && NATIVE=1 && KERNELS="native"
row "device tests" 300 env LOOM_TEST_DEVICE="$DEVICE" LOOM_TRITON_NATIVE=$NATIVE "$PY" -m pytest \
    -q -p no:cacheprovider tests/test_device_path.py
row "triton kernels $KERNELS" 300 env LOOM_TRITON_NATIVE=$NATIVE "$PY" -m pytest -q \
    -p no:cacheprovider tests/test_triton_attention.py
row "decode graphs replay = eager" 300 env LOOM_TEST_DEVICE="$DEVICE" LOOM_TRITON_NATIVE=$NATIVE \
    "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py

for model in $MODELS; do
    row "build $model" 300 "$PY" -m bench.gpu_models --tokenizer .whl/tokenizer \
        --out "$OUT/models" --only "$model"
done

for model in $MODELS; do
    dir="$(ls -d "$OUT"/models/"$model"* 2>/dev/null | head -n 1)"
    [ -n "$dir" ] || continue
    row "W1 offline $model" 300 "$PY" -m bench.offline --model "$dir" --device "$DEVICE" \
        --modes continuous --num-prompts "$PROMPTS" --output-len "$OUTPUT_LEN"
    row "W1 served $model c=$CONCURRENCY" 600 "$PY" -m bench.compare --model "$dir" \
        --modes continuous --concurrency "$CONCURRENCY" --num-prompts "$PROMPTS" \
        --output-len "$OUTPUT_LEN" --no-progress --launch-args="--device $DEVICE" \
        --log-dir "$OUT/launch-$model" --save-json "$OUT/w1-$model.json" \
        --output "$OUT/w1-$model.md"
    row "transformers generate $model" 600 "$PY" -m bench.hf_generate --model "$dir" \
        --device "$DEVICE" --batch "1,${CONCURRENCY##*,}" --num-prompts "$PROMPTS" \
        --output-len "$OUTPUT_LEN"
done

echo "| total | | $(($(date +%s) - started)) | |" >>"$TABLE"
echo
cat "$TABLE"
for model in $MODELS; do
    [ -f "$OUT/w1-$model.md" ] && { echo; echo "W1 served, $model:"; grep '^|' "$OUT/w1-$model.md"; }
    log="$OUT/transformers_generate_$model.log"
    [ -f "$log" ] && { echo; echo "transformers, $model:"; grep '^|' "$log"; }
    log="$OUT/W1_offline_$model.log"
    [ -f "$log" ] && { echo; echo "W1 offline, $model:"; grep '^|' "$log"; }
done
