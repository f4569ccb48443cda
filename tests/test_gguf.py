"""GGUF files served as they are (`--model FILE.gguf`).

Engine tier: a tiny Llama written to a GGUF in the test (Q4_1, Q4_0, Q8_0 and F32 tensors,
q/k permuted as llama.cpp stores them; Q4_K blocks on their own, gguf cannot write them)
loads with its Q4 linears kept as the file's codes,
which decode exactly as gguf's own dequantization, and its logits match the float model
made from those dequantized weights. Start-up errors: a damaged file and another
architecture name the file and the reason, through launch.py too, which leaves nothing
running. End to end: launch.py serves the default model's own Q4_1 GGUF to the OpenAI SDK,
and a hub id (`org/name`) from a hub-layout cache with HF_HUB_OFFLINE set.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.launched import REPO_ROOT
from common.default_model import default_gguf_file
from common.gguf_convert import dequantize_q8_0, unpermute_rotary
from common.gguf_model import prepare_gguf
from common.sockets import free_port
from engine.quantization.base import FLOAT32_KERNEL_ROWS, QuantizedLinear
from engine.quantization.int4 import Int4Linear
from engine.quantization.q8_0 import Q8_0Linear
from engine.weights.gguf import (
    q4_codes,
    q5_0_codes,
    q6_k_codes,
)
from engine.weights.gguf_file import GGUFTensor, read_tensors
from engine.weights.loader import load_model
from tests.launched_server import LaunchedServer
from tests.model_fixtures import TINY_LLAMA, build_tiny_hf_model
from tests.test_model_parity import prefill_logits

GGUF_LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                    "post_attention_layernorm": "ffn_norm"}
GGUF_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                     "lm_head": "output"}
# One file, several kinds, every linear kept as its codes (Q4 as int4 groups, Q8_0 as is).
TENSOR_TYPES = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q4_0",
                "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q8_0", "output": "Q4_0"}


def permute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (interleaved rotary pairs), the inverse of unpermute_rotary."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, 2, rows // num_heads // 2, cols).swapaxes(1, 2).reshape(
        rows, cols)


def gguf_name(hf_name: str) -> str:
    base, _, suffix = hf_name.rpartition(".")
    if base.startswith("model.layers."):
        _, _, index, module = base.split(".", 3)
        return f"blk.{index}.{GGUF_LAYER_NAMES[module]}.{suffix}"
    return f"{GGUF_GLOBAL_NAMES[base]}.{suffix}"


def write_tiny_gguf(path: Path, architecture: str = "llama",
                    types: dict[str, str] = TENSOR_TYPES, tied: bool = False) -> None:
    """`tied`: no output tensor, so the head is the embedding (SmolLM2's layout)."""
    import gguf

    hf_model = build_tiny_hf_model()
    config = TINY_LLAMA
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    for hf_name, tensor in hf_model.state_dict().items():
        name = gguf_name(hf_name)
        if tied and name == "output.weight":
            continue
        weight = tensor.float().numpy()
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            weight = permute_rotary(weight, heads if "attn_q" in name else kv_heads)
        kind = types.get(name.split(".")[-2], "F32")
        if kind == "F32":
            writer.add_tensor(name, np.ascontiguousarray(weight))
        else:
            quant_type = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(weight, quant_type),
                              raw_dtype=quant_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "tiny-q4.gguf"
    write_tiny_gguf(path)
    return path


def test_q4_linears_keep_the_files_codes_and_match_float_math(tiny_gguf: Path,
                                                              tmp_path: Path) -> None:
    model_dir = prepare_gguf(str(tiny_gguf), tmp_path / "cache", with_tokenizer=False)
    assert Path(model_dir).name == "tiny-q4"  # served under the file's name
    float_model = load_model(model_dir, torch.float32, torch.device("cpu"), quantization="none")
    # fp32 keeps the codes too: our kernels read them for steps of up to 15 tokens.
    quantized = load_model(model_dir, torch.float32, torch.device("cpu"))
    kept = [module for module in quantized.modules() if isinstance(module, QuantizedLinear)]
    assert len(kept) == 4 * TINY_LLAMA["num_hidden_layers"] + 1
    assert all(module.kernel_rows == FLOAT32_KERNEL_ROWS for module in kept)
    layer = quantized.model.layers[0]
    for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   quantized.lm_head):
        assert isinstance(module, Int4Linear)
    assert isinstance(layer.mlp.down_proj, Q8_0Linear)
    # The codes decode exactly as gguf's own dequantization did for the float model.
    for index, layer in enumerate(quantized.model.layers):
        reference = float_model.model.layers[index]
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                     "mlp.down_proj"):
            ours = layer.get_submodule(name).dequantized_weight()
            theirs = reference.get_submodule(name).weight
            assert (ours - theirs).abs().max().item() <= 1e-6 * theirs.abs().max().item()
    for length in (1, FLOAT32_KERNEL_ROWS, 40):  # the kernels, then the fp32 copies
        prompt = [(5 * i + 7) % 250 + 3 for i in range(length)]
        difference = prefill_logits(quantized, prompt) - prefill_logits(float_model, prompt)
        assert difference.abs().max().item() < 1e-4


def test_a_tied_q8_0_embedding_becomes_a_q8_0_head_and_stays_float_for_lookups(
        tmp_path: Path) -> None:
    """SmolLM2's GGUF: the head is the Q8_0 embedding. In bf16 the head reads its codes
    through the C++ kernel for decode-sized steps (the tiled one where the CPU multiplies
    bf16 pairs), the lookup reads a float copy, and the logits are float math on the
    dequantized weights (bf16-rounded activations aside)."""
    path = tmp_path / "tiny-tied.gguf"
    write_tiny_gguf(path, types={**TENSOR_TYPES, "token_embd": "Q8_0"}, tied=True)
    model_dir = prepare_gguf(str(path), tmp_path / "cache", with_tokenizer=False)
    float_model = load_model(model_dir, torch.float32, torch.device("cpu"), quantization="none")
    model = load_model(model_dir, torch.bfloat16, torch.device("cpu"))
    head = model.lm_head
    assert isinstance(head, Q8_0Linear)
    assert head.kernel_rows == (Q8_0Linear.tiled_kernel_rows if head.tiled else 4)
    embedding = float_model.model.embed_tokens.weight
    assert torch.equal(head.dequantized_weight(), embedding)  # q·d, exactly
    assert torch.equal(model.model.embed_tokens.weight, embedding.bfloat16())
    for length in (1, 3, 24):  # 1 and 3 rows: the kernel; 24: the dense copy
        prompt = [(7 * i + 3) % 250 + 3 for i in range(length)]
        ours = prefill_logits(model, prompt)
        theirs = prefill_logits(float_model, prompt)
        assert (ours - theirs).abs().max().item() < 0.05 * theirs.abs().max().item()
        hidden = torch.randn(min(length, 4), embedding.shape[1]).bfloat16()
        exact = hidden.float() @ embedding.T
        assert (head(hidden).float() - exact).abs().max().item() <= (
            2**-7 * exact.abs().max().item())


def test_bf16_keeps_the_codes_by_default(tiny_gguf: Path, tmp_path: Path) -> None:
    model_dir = prepare_gguf(str(tiny_gguf), tmp_path / "cache", with_tokenizer=False)
    model = load_model(model_dir, torch.bfloat16, torch.device("cpu"))
    assert isinstance(model.model.layers[1].self_attn.qkv_proj, Int4Linear)
    requantized = load_model(model_dir, torch.bfloat16, torch.device("cpu"), quantization="int8")
    assert not any(isinstance(module, Int4Linear) for module in requantized.modules())


def test_the_fast_tensor_scan_finds_what_ggufs_reader_finds(tiny_gguf: Path,
                                                             tmp_path: Path) -> None:
    from common.gguf_model import read_gguf

    ours, theirs = read_tensors(tiny_gguf), read_gguf(tiny_gguf).tensors
    assert [t.name for t in ours] == [t.name for t in theirs]
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.tensor_type == reference.tensor_type
        assert mine.shape == tuple(int(dim) for dim in reference.shape)
        assert np.array_equal(mine.data.reshape(-1).view(np.uint8),
                              np.asarray(reference.data).reshape(-1).view(np.uint8))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"truncated\.gguf: not a readable GGUF file"):
        read_tensors(truncated)


def test_q4_k_blocks_reduce_exactly_to_groups_of_32() -> None:
    """Random Q4_K super-blocks (sane fp16 d and dmin; every scale, min and code pattern
    else): our codes, scales and zeros give gguf's own dequantization exactly."""
    import gguf
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    rows, columns = 6, 512
    raw = rng.integers(0, 256, (rows, columns // 256 * 144), dtype=np.uint8)
    halves = (rng.random((rows, columns // 256, 2)) * 0.02 + 1e-3).astype(np.float16)
    raw.reshape(rows, -1, 144)[..., 0:4] = halves.view(np.uint8).reshape(rows, -1, 4)
    kind = gguf.GGMLQuantizationType.Q4_K
    q, scale, zero = q4_codes(GGUFTensor("blk.0.ffn_up.weight", kind, (columns, rows), raw))
    ours = (q.reshape(rows, -1, 32) - 8.0) * scale[..., None] + zero[..., None]
    expected = dequantize(raw, kind).reshape(rows, columns)
    assert np.array_equal(ours.reshape(rows, columns).astype(np.float32), expected)


def test_q5_0_blocks_are_exactly_int8_codes_with_their_scale() -> None:
    """Random Q5_0 blocks (sane fp16 d; every fifth-bit and nibble pattern): codes q - 16
    times d give gguf's own dequantization exactly, and stay within -16..15."""
    import gguf
    from gguf.quants import dequantize

    rng = np.random.default_rng(1)
    rows, columns = 5, 640
    raw = rng.integers(0, 256, (rows, columns // 32 * 22), dtype=np.uint8)
    d = (rng.random((rows, columns // 32)) * 0.02 + 1e-3).astype(np.float16)
    raw.reshape(rows, -1, 22)[..., 0:2] = d.view(np.uint8).reshape(rows, -1, 2)
    kind = gguf.GGMLQuantizationType.Q5_0
    q, scale = q5_0_codes(GGUFTensor("blk.0.ffn_up.weight", kind, (columns, rows), raw))
    assert q.dtype == np.int8 and q.min() >= -16 and q.max() <= 15
    assert q.min() == -16 and q.max() == 15  # every code seen: the fifth bit lands
    ours = q.reshape(rows, -1, 32).astype(np.float32) * scale[..., None]
    expected = dequantize(raw, kind).reshape(rows, columns)
    assert np.array_equal(ours.reshape(rows, columns), expected)


# The tensor types llama.cpp writes for today's models, one per linear of a 256-wide layer
# (K-quants need rows of 256): kept where the type has a kernel, dequantized otherwise.
MIXED_TYPES = {"attn_q": "Q5_K", "attn_k": "Q6_K", "attn_v": "F16", "attn_output": "BF16",
               "ffn_gate": "Q6_K", "ffn_up": "Q5_0", "ffn_down": "Q4_K"}
K_QUANT_SCALES = {"Q4_K": (0, 144), "Q5_K": (0, 176), "Q6_K": (208, 210)}  # d: (offset, block)


def random_tensor(kind: str, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """Random data of a GGUF type: K-quant blocks of random bytes with sane fp16 scales
    (gguf cannot quantize to K-quants), the rest quantized from random floats."""
    import gguf

    if kind not in K_QUANT_SCALES:
        return gguf.quants.quantize(rng.standard_normal((rows, columns)).astype(np.float32),
                                    gguf.GGMLQuantizationType[kind])
    offset, block = K_QUANT_SCALES[kind]
    raw = rng.integers(0, 256, (rows, columns // 256, block), dtype=np.uint8)
    width = 4 if kind != "Q6_K" else 2  # d and dmin, or d alone
    halves = (rng.random((rows, columns // 256, width // 2)) * 0.02 + 1e-3).astype(np.float16)
    raw[..., offset:offset + width] = halves.view(np.uint8).reshape(rows, -1, width)
    return raw.reshape(rows, -1)


def test_every_common_tensor_type_loads_as_ggufs_own_dequantization(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import gguf
    from gguf.quants import dequantize

    hidden, inner, heads, kv_heads, head_dim = 256, 512, 4, 2, 64
    shapes = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
              "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, hidden),
              "ffn_gate": (inner, hidden), "ffn_up": (inner, hidden), "ffn_down": (hidden, inner)}
    rng = np.random.default_rng(3)
    path = tmp_path / "tiny-mixed.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_context_length, 512), (writer.add_embedding_length, hidden),
                       (writer.add_block_count, 1), (writer.add_feed_forward_length, inner),
                       (writer.add_head_count, heads), (writer.add_head_count_kv, kv_heads),
                       (writer.add_rope_dimension_count, head_dim),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_vocab_size, 256)):
        add(value)
    expected = {}
    for kind, (rows, columns) in shapes.items():
        data = random_tensor(MIXED_TYPES[kind], rows, columns, rng)
        quant_type = gguf.GGMLQuantizationType[MIXED_TYPES[kind]]
        writer.add_tensor(f"blk.0.{kind}.weight", data, raw_dtype=quant_type)
        expected[kind] = dequantize(data, quant_type).reshape(rows, columns)
    for name, shape in (("token_embd", (256, hidden)), ("output", (256, hidden)),
                        ("output_norm", (hidden,)), ("blk.0.attn_norm", (hidden,)),
                        ("blk.0.ffn_norm", (hidden,))):
        writer.add_tensor(f"{name}.weight", rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model_dir = prepare_gguf(str(path), tmp_path / "cache", with_tokenizer=False)
    layer = load_model(model_dir, torch.float32, torch.device("cpu"),
                       quantization="none").model.layers[0]
    qkv = np.concatenate([unpermute_rotary(expected["attn_q"], heads),
                          unpermute_rotary(expected["attn_k"], kv_heads), expected["attn_v"]])
    for module, want in (("self_attn.qkv_proj", qkv), ("self_attn.o_proj", expected["attn_output"]),
                         ("mlp.gate_up_proj",
                          np.concatenate([expected["ffn_gate"], expected["ffn_up"]])),
                         ("mlp.down_proj", expected["ffn_down"])):
        assert np.array_equal(layer.get_submodule(module).weight.numpy(), want), module
    # In bf16 the Q6_K + Q5_0 pair keeps its codes as int8 (scales per 16: the Q5_0 half's
    # repeated), the Q4_K down projection as int4; the rest (Q5_K among them) is served float.
    with caplog.at_level("INFO", logger="loom.engine"):
        layer = load_model(model_dir, torch.bfloat16, torch.device("cpu")).model.layers[0]
    assert "served dequantized to float: 1 Q5_K, 1 Q6_K (" in caplog.text  # one line
    gate_up = layer.mlp.gate_up_proj
    assert isinstance(gate_up, Q8_0Linear) and gate_up.block == 16
    assert np.array_equal(gate_up.dequantized_weight().numpy(),
                          np.concatenate([expected["ffn_gate"], expected["ffn_up"]]))
    assert isinstance(layer.mlp.down_proj, Int4Linear)
    assert not isinstance(layer.self_attn.qkv_proj, (Int4Linear, Q8_0Linear))


def test_q8_0_dequantizes_to_ggufs_own_values_in_one_pass() -> None:
    import gguf
    from gguf.quants import dequantize

    rng = np.random.default_rng(8)
    data = random_tensor("Q8_0", 48, 96, rng)  # [rows, bytes of a row]
    want = dequantize(data, gguf.GGMLQuantizationType.Q8_0)
    got = dequantize_q8_0(data)
    assert got.dtype == np.float32 and got.shape == want.shape == (48, 96)
    assert np.array_equal(got, want)


def test_q6_k_blocks_are_exactly_int8_codes_with_a_scale_per_16() -> None:
    import gguf
    from gguf.quants import dequantize

    rng = np.random.default_rng(4)
    rows, columns = 3, 512
    raw = random_tensor("Q6_K", rows, columns, rng)
    kind = gguf.GGMLQuantizationType.Q6_K
    q, scale = q6_k_codes(GGUFTensor("blk.0.ffn_down.weight", kind, (columns, rows), raw))
    assert q.dtype == np.int8 and q.min() == -32 and q.max() == 31
    ours = q.reshape(rows, -1, 16).astype(np.float32) * scale[..., None]
    assert np.array_equal(ours.reshape(rows, columns), dequantize(raw, kind))


def test_rotary_permutation_round_trips() -> None:
    weight = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    assert np.array_equal(unpermute_rotary(permute_rotary(weight, 2), 2), weight)


def test_damaged_or_foreign_files_name_the_file_and_the_reason(tmp_path: Path,
                                                               tiny_gguf: Path) -> None:
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(tiny_gguf.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"damaged\.gguf: not a readable GGUF file"):
        prepare_gguf(str(damaged), tmp_path / "cache")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match=r"garbage\.gguf: not a readable GGUF file"):
        prepare_gguf(str(garbage), tmp_path / "cache")
    foreign = tmp_path / "foreign.gguf"
    write_tiny_gguf(foreign, architecture="gpt2")
    with pytest.raises(ValueError, match=r"foreign\.gguf: architecture 'gpt2' is not supp"):
        prepare_gguf(str(foreign), tmp_path / "cache")
    no_tokenizer = tmp_path / "no-tokenizer.gguf"
    no_tokenizer.write_bytes(tiny_gguf.read_bytes())
    with pytest.raises(ValueError, match=r"no-tokenizer\.gguf: no usable tokenizer"):
        prepare_gguf(str(no_tokenizer), tmp_path / "cache")


@pytest.mark.e2e
def test_launch_refuses_a_damaged_gguf_and_leaves_nothing_running(tmp_path: Path) -> None:
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(b"GGUF" + os.urandom(64))
    launch = subprocess.Popen(
        [sys.executable, "launch.py", "--model", str(damaged), "--port", str(free_port())],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=os.environ | {"LOOM_CACHE": str(tmp_path / "cache")})
    output, _ = launch.communicate(timeout=120)
    assert launch.returncode == 2
    assert f"{damaged}: not a readable GGUF file" in output
    assert "Traceback" not in output
    assert not processes_mentioning(str(damaged))


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.e2e
def test_launch_serves_the_default_models_own_gguf(tmp_path: Path) -> None:
    import openai

    gguf_file = default_gguf_file()
    # bf16: in fp32 (the default without native bf16) the codes are not kept
    server = LaunchedServer(["--model", gguf_file, "--num-kv-blocks", "256", "--dtype", "bfloat16"])
    with server.start(tmp_path):
        assert "121 linears keep the file's codes" in server.log  # and the Q8_0 head
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        (model,) = client.models.list().data
        assert model.id == Path(gguf_file).stem
        # The bare question's first token is a near tie even in fp32 ("The" 0.08 above "L"),
        # which bf16 kernels may flip; this one's first eight tokens lead by >= 0.99 in fp32.
        question = "What is the capital of France? Answer with the city's name."
        stream = client.chat.completions.create(
            model=model.id, stream=True, max_tokens=12, temperature=0,
            messages=[{"role": "user", "content": question}])
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        assert "Paris" in text
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.e2e
def test_launch_serves_a_hub_id_from_the_offline_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import openai

    from tests.test_model_parity import hub_layout_cache
    from tests.tiny_server import build_tiny_served_model

    source = Path(build_tiny_served_model(tmp_path / "model"))
    hub_layout_cache(tmp_path / "hub", "acme/tiny-llama", source)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    server = LaunchedServer(["--model", "acme/tiny-llama", "--dtype", "float32",
                             "--num-kv-blocks", "64"])
    with server.start(tmp_path):
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        assert [model.id for model in client.models.list().data] == ["acme/tiny-llama"]
        stream = client.completions.create(model="acme/tiny-llama", prompt="Hello",
                                           max_tokens=3, stream=True)
        assert [chunk.choices[0].finish_reason for chunk in stream][-1] == "length"
