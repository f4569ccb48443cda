#!/usr/bin/env bash
# The GPU check: ONE script, run from the repository root on a CUDA machine that has torch,
# triton, transformers, aiohttp and msgpack but no network. Prepare on the CPU machine first
# with `bench/gpu_prepare.sh` (wheels and tokenizer files into .whl/). It prints one table:
#   - tests on the GPU, run side by side: logit parity vs transformers (fp32, bf16), the
#     engine oracle with chunked prefill and forced preemption (tests/test_device_path.py),
#     the Triton kernels compiled natively vs the torch reference
#     (tests/test_triton_attention.py), decode steps replayed from CUDA graphs equal to the
#     eager engine (tests/test_cuda_graphs.py); beside them, random-weight models built from
#     configs (a ~1B Llama shape, SmolLM2-135M's);
#   - then per model: W1 served through launch.py with streaming requests at c=1 and at
#     GPU_CHECK_CONCURRENCY (bench.compare), transformers' static `generate` at batch 1 and at
#     the highest concurrency (bench.hf_generate), W1 offline (bench.offline); for the first
#     model, which kernels a decode step runs and for how long (bench.gpu_step_profile), and
#     on CUDA the Triton attention kernel alone by tile (bench.triton_attention).
# Every row's time limit is capped by what is left of GPU_CHECK_SECONDS (default 540): a row
# that would start with under 20 s left is skipped, so the whole check fits one device call.
# Everything lands in $OUT (default /tmp/loom-gpu-check): logs, JSON, table.md.
#
# A dry run on the CPU checks the plumbing with small numbers:
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_MODELS=smollm2 GPU_CHECK_PROMPTS=8 GPU_CHECK_C1_PROMPTS=2 \
#   GPU_CHECK_CONCURRENCY=4 GPU_CHECK_OUTPUT_LEN=16 bench/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
MODELS="${GPU_CHECK_MODELS:-llama-1b smollm2}"
PROMPTS="${GPU_CHECK_PROMPTS:-256}"
C1_PROMPTS="${GPU_CHECK_C1_PROMPTS:-16}"
CONCURRENCY="${GPU_CHECK_CONCURRENCY:-64,256}"
OUTPUT_LEN="${GPU_CHECK_OUTPUT_LEN:-128}"
BUDGET="${GPU_CHECK_SECONDS:-540}"
OUT="${OUT:-/tmp/loom-gpu-check}"
MODEL_DIR="${GPU_CHECK_MODEL_DIR:-$OUT/models}"
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

# row NAME LIMIT COMMAND...: runs COMMAND for at most LIMIT seconds (less if the budget is
# nearly spent), logs to $OUT/NAME.log, adds a table row whose detail is the log's last line
# that is not blank. Rows may run side by side: each appends one short line.
row() {
    local name="$1" limit="$2"
    shift 2
    local log="$OUT/${name// /_}.log" begin=$(date +%s) status detail
    local left=$((started + BUDGET - begin))
    if [ "$left" -lt 20 ]; then
        echo "| $name | skipped: budget spent | 0 | |" >>"$TABLE"
        echo "[gpu_check] $name: skipped"
        return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    timeout -k 10 "$limit" "$@" >"$log" 2>&1
    case $? in 0) status=pass ;; 124|137) status="TIMEOUT ${limit}s" ;; *) status=FAIL ;; esac
    detail="$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | tr '|' '/' | cut -c1-160)"
    echo "| $name | $status | $(($(date +%s) - begin)) | $detail |" >>"$TABLE"
    echo "[gpu_check] $name: $status"
}

# On a GPU the Triton kernels compile natively; on the CPU they go through the interpreter.
NATIVE=0
KERNELS="interpreted"
[ "$DEVICE" = cuda ] && NATIVE=1 && KERNELS="native"
pytest_row() {
    row "$1" 240 env LOOM_TEST_DEVICE="$DEVICE" LOOM_TRITON_NATIVE=$NATIVE "$PY" -m pytest -q \
        -p no:cacheprovider "$2"
}
pytest_row "device tests" tests/test_device_path.py &
pytest_row "triton kernels $KERNELS" tests/test_triton_attention.py &
pytest_row "decode graphs replay = eager" tests/test_cuda_graphs.py &
for model in $MODELS; do
    row "build $model" 240 "$PY" -m bench.gpu_models --tokenizer .whl/tokenizer \
        --out "$MODEL_DIR" --only "$model" &
done
wait

top="${CONCURRENCY##*,}"
for model in $MODELS; do
    dir="$(ls -d "$MODEL_DIR"/"$model"* 2>/dev/null | head -n 1)"
    [ -n "$dir" ] || continue
    for levels in 1 "$CONCURRENCY"; do
        prompts=$PROMPTS
        [ "$levels" = 1 ] && prompts=$C1_PROMPTS
        row "W1 served $model c=$levels" 240 "$PY" -m bench.compare --model "$dir" \
            --modes continuous --concurrency "$levels" --num-prompts "$prompts" \
            --output-len "$OUTPUT_LEN" --reuse-server --no-progress \
            --launch-args="--device $DEVICE" --log-dir "$OUT/launch-$model-c$levels" \
            --save-json "$OUT/w1-$model-c$levels.json" --output "$OUT/w1-$model-c$levels.md"
    done
    if [ "$model" = "${MODELS%% *}" ]; then  # the first model's kernels, graphs and eager
        row "step profile $model" 120 "$PY" -m bench.gpu_step_profile --model "$dir" \
            --device "$DEVICE" --batch "1,64" --steps 20
        [ "$DEVICE" = cuda ] && row "attention kernel sweep" 60 "$PY" -m bench.triton_attention \
            --shapes 32/8x64 --tiles 32,64,128 --warps 4 --repeats 10
    fi
    row "transformers generate $model" 180 "$PY" -m bench.hf_generate --model "$dir" \
        --device "$DEVICE" --batch "1,$top" --max-batches "$C1_PROMPTS" \
        --num-prompts "$PROMPTS" --output-len "$OUTPUT_LEN"
    row "W1 offline $model" 120 "$PY" -m bench.offline --model "$dir" --device "$DEVICE" \
        --modes continuous --num-prompts "$PROMPTS" --output-len "$OUTPUT_LEN"
done

echo "| total | | $(($(date +%s) - started)) | |" >>"$TABLE"
echo
cat "$TABLE"
for model in $MODELS; do
    for levels in 1 "$CONCURRENCY"; do
        report="$OUT/w1-$model-c$levels.md"
        [ -f "$report" ] && { echo; echo "W1 served, $model:"; grep '^|' "$report"; }
    done
    log="$OUT/transformers_generate_$model.log"
    [ -f "$log" ] && { echo; echo "transformers, $model:"; grep '^|' "$log"; }
    log="$OUT/W1_offline_$model.log"
    [ -f "$log" ] && { echo; echo "W1 offline, $model:"; grep '^|' "$log"; }
    log="$OUT/step_profile_$model.log"
    [ -f "$log" ] && { echo; echo "step profile, $model:"; grep -v -i warn "$log" | cut -c1-150; }
    log="$OUT/attention_kernel_sweep.log"
    [ -f "$log" ] && [ "$model" = "${MODELS%% *}" ] && { echo; echo "attention kernel:"; grep '^|' "$log"; }
done
