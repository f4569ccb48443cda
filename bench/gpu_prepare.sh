#!/usr/bin/env sh
# CPU side of the GPU check, one command from the repository root: fills .whl/ (ignored by
# git) with what bench/gpu_check.sh needs on a CUDA machine that has torch, triton,
# transformers, aiohttp and msgpack but no network:
#   .whl/*.whl       wheels of the packages it lacks (Python 3.12, manylinux x86-64)
#   .whl/tokenizer/  the default model's config and tokenizer files (no weights: the check
#                    builds random-weight models from the config)
# Then hand the tree and .whl/ to the GPU machine (docs/DEVELOPERS.md) and run
# `bench/gpu_check.sh` there.
set -eu
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
PY_VERSION="${GPU_PY_VERSION:-3.12}"
mkdir -p .whl/tokenizer
rm -f .whl/*.whl
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64 -d .whl \
    pyzmq gguf pytest-asyncio llguidance openai pydantic pydantic-core jiter distro sniffio \
    annotated-types typing-inspection typing-extensions httpx httpcore h11 anyio certifi idna \
    tqdm pyyaml prometheus-client
model_dir="$("$PYTHON" -c 'from common.default_model import resolve_model; print(resolve_model(None))')"
for name in config.json generation_config.json tokenizer.json tokenizer_config.json \
        chat_template.jinja special_tokens_map.json; do
    [ -f "$model_dir/$name" ] && cp "$model_dir/$name" .whl/tokenizer/
done
du -sh .whl
ls .whl
