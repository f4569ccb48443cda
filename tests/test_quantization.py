"""Quantized linears (`--quantization int8 | int4 | w8a8 | w4a8`) against float math on their
own dequantized weights (w8a8, w4a8: and on their fake-quantized activations).

Layer tier: each format's product on random weights, fp32 and bf16. Engine tier: a tiny model
served quantized generates, greedy and in a mixed batch with preemption, what transformers'
`generate` gives on the same dequantized weights (activations fake-quantized by hooks for
w8a8 and w4a8), and its logits agree with that reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.kernels import moe_int4, w4a8
from engine.kernels import w8a8 as w8a8_kernels
from engine.kernels.int4_matmul import load_int4_kernel
from engine.kernels.q8_0_matmul import load_q8_kernel, tiles_serve
from engine.layers.batch_invariant import MIN_ROWS, MIN_ROWS_FP32
from engine.platform.cpu import cpu_flags
from engine.quantization.base import FLOAT32_KERNEL_ROWS, QuantizedLinear
from engine.quantization.int4 import Int4Linear, grouped_kernel_rows
from engine.quantization.int8 import Int8Linear
from engine.quantization.q8_0 import Q8_0Linear
from engine.quantization.registry import attach_dense_copies, quantize_linears
from engine.quantization.unquantized import packing_applies
from engine.quantization.w8a8 import W8A8Linear
from engine.weights.loader import load_model
from tests.engine_helpers import (
    assert_equals_transformers_generate,
    greedy_request,
    make_core,
    run_to_completion,
)
from tests.model_fixtures import build_tiny_hf_model
from tests.test_model_parity import prefill_logits

METHODS = ("int8", "int4", "w8a8", "w4a8")
LAYERS = {"int8": Int8Linear, "int4": Int4Linear, "w8a8": W8A8Linear,
          "w4a8": functools.partial(Int4Linear, int8_activations=True)}
# Relative to the largest output. fp32: summation order only. bf16: the kernels round the
# dequantized weights or partial sums to bf16 as well as the product (measured: ~5e-3).
LAYER_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# fp32 model, through every layer. w8a8: a 1e-7 difference upstream can move an activation
# across a rounding boundary of its int8 code, which moves a logit by up to ~1e-2 here.
LOGIT_TOLERANCE = {"int8": 1e-3, "int4": 1e-3, "w8a8": 2e-2, "w4a8": 2e-2}


def fake_quantized(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x as a layer quantizing its activations sees it (w8a8 per token, w4a8 per 32)."""
    if isinstance(layer, W8A8Linear):
        return W8A8Linear.fake_quantized_input(x)
    if isinstance(layer, Int4Linear) and not layer.weight_only:
        return w4a8.fake_quantize_groups(x)
    return x


def reference_product(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    return fake_quantized(layer, x).float() @ layer.dequantized_weight().T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", METHODS)
def test_layer_equals_float_math_on_its_dequantized_weights(method: str,
                                                             dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(192, 128, generator=generator).to(dtype)
    bias = torch.randn(192, generator=generator).to(dtype)
    layer = LAYERS[method](weight, bias)
    for rows in (1, 5, 64):
        x = torch.randn(rows, 128, generator=generator).to(dtype)
        out = layer(x)
        assert out.dtype == dtype and out.shape == (rows, 192)
        expected = reference_product(layer, x) + bias.float()
        scale = expected.abs().max().item()
        assert (out.float() - expected).abs().max().item() <= LAYER_TOLERANCE[dtype] * scale
    if method in ("int4", "w4a8"):  # once loaded, the codes come back out of their packing
        loaded = layer.dequantized_weight()
        layer.finish_loading()
        assert torch.equal(layer.dequantized_weight(), loaded)
    # The quantization itself stays close to the float weight it came from.
    error = (layer.dequantized_weight() - weight.float()).abs().max().item()
    bound = 0.02 if method in ("int8", "w8a8") else 0.2
    assert error <= bound * weight.float().abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_w8a8_cpp_passes_equal_the_torch_ops_bit_for_bit(dtype: torch.dtype) -> None:
    """The C++ activation quantization and rescale (engine.kernels.w8a8) are what the
    layer runs on the CPU; the reference math is the torch ops'."""
    assert w8a8_kernels.load_w8a8_kernels() is not None
    generator = torch.Generator().manual_seed(3)
    layer = W8A8Linear(torch.randn(70, 96, generator=generator), None)
    for rows in (1, 5, 64):
        x = (torch.randn(rows, 96, generator=generator)
             * torch.rand(rows, 1, generator=generator) * 30).to(dtype)
        x[0] = 0  # an all-zero row: the smallest normal scale, every code 0
        codes, scales = w8a8_kernels.quantize_rows(x)
        expected_codes, expected_scales = W8A8Linear.quantize_input(x)
        assert torch.equal(codes, expected_codes) and torch.equal(scales, expected_scales)
        acc = torch._int_mm(codes, layer.qweight_t)
        out = w8a8_kernels.rescale(acc, scales, layer.scale, dtype)
        assert torch.equal(out, (acc.float() * expected_scales * layer.scale).to(dtype))
    with pytest.raises(ValueError, match="w8a8 rescale"):
        w8a8_kernels.rescale(acc.float(), scales, layer.scale, dtype)


def test_the_cpp_int8_gemm_equals_int_mm_bit_for_bit() -> None:
    """Where oneDNN has no int8 dot-product instructions, w8a8 multiplies with a kernel of
    ours (engine.kernels.w8a8.int8_matmul): exact int32 sums, so torch._int_mm's numbers, for
    any row count, a K that is no multiple of 32, and the extreme codes."""
    assert w8a8_kernels.load_w8a8_kernels() is not None
    generator = torch.Generator().manual_seed(8)
    for rows, k, n in ((1, 576, 70), (3, 100, 37), (6, 64, 33), (70, 96, 48)):
        a = torch.randint(-127, 128, (rows, k), generator=generator, dtype=torch.int8)
        weight = torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8)
        a[0], weight[0] = 127, -128  # the largest products, every one alike
        weight[1] = 0
        assert torch.equal(w8a8_kernels.int8_matmul(a, weight), torch._int_mm(a, weight.T))
    with pytest.raises(ValueError, match="int8 matmul"):
        w8a8_kernels.int8_matmul(a.float(), weight)
    cpu_has_int8_dot = bool(cpu_flags() & w8a8_kernels.INT8_DOT_FLAGS)
    assert W8A8Linear(torch.randn(8, 64), None).uses_int8_gemm == (not cpu_has_int8_dot)


@pytest.mark.parametrize("block", [32, 16], ids=["q8_0", "q6_k-blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_q8_0_layer_equals_float_math_on_its_codes(dtype: torch.dtype, block: int) -> None:
    """int8 codes with one scale per block of 32 (Q8_0, Q5_0) or 16 (Q6_K) through the C++
    kernel (1-4 rows) and past it (dequantized weight, or the packed copy once attached)."""
    assert load_q8_kernel() is not None
    generator = torch.Generator().manual_seed(2)
    codes = torch.randint(-127, 128, (70, 96), generator=generator, dtype=torch.int8)
    scales = torch.rand(70, 96 // block, generator=generator) * 0.01
    bias = torch.randn(70, generator=generator).to(dtype)
    layer = Q8_0Linear(codes, scales, bias, dtype)
    weight = (codes.float().view(70, -1, block) * scales[..., None]).view(70, 96)
    assert torch.equal(layer.dequantized_weight(), weight)
    for attach in (False, True):
        if attach:
            attach_dense_copies([layer])
        for rows in (1, 2, 3, 4, 5, 33):
            x = torch.randn(rows, 96, generator=generator).to(dtype)
            expected = x.float() @ weight.T + bias.float()
            out = layer(x)
            assert out.dtype == dtype and out.shape == (rows, 70)
            scale = expected.abs().max().item()
            assert (out.float() - expected).abs().max().item() <= LAYER_TOLERANCE[dtype] * scale
    with pytest.raises(ValueError, match="Q8_0"):
        Q8_0Linear(codes, scales[:, :1], None, dtype)


@pytest.mark.parametrize("method", ["int8", "int4", "w4a8"])
def test_weight_only_layers_run_larger_steps_on_their_dense_copy(method: str) -> None:
    """w4a8's copy multiplies the fake-quantized activations: the same function."""
    generator = torch.Generator().manual_seed(1)
    layer = LAYERS[method](torch.randn(96, 64, generator=generator), None)
    layer.keep_dense_copy(torch.float32)
    calls: list[int] = []
    layer.dense.register_forward_hook(lambda _, args, __: calls.append(args[0].shape[0]))
    for rows in (1, layer.max_kernel_rows, layer.max_kernel_rows + 1, 64):
        x = torch.randn(rows, 64, generator=generator)
        out = layer(x)
        expected = reference_product(layer, x)
        assert (out - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    assert calls == [layer.max_kernel_rows + 1, 64]


def test_bf16_int4_layers_read_their_codes_up_to_the_grouped_kernels_rows() -> None:
    """Where the grouped kernel serves (AVX512-BF16), bf16 steps of up to grouped_kernel_rows()
    tokens read the codes; larger ones, and every step above torch's 4 rows elsewhere, the
    dense copy, where oneDNN packs bf16 (without AVX-512 it cannot: no copy, every step on
    the codes). Each equals float math on the dequantized weight. Steps with prompt rows,
    padded to MIN_ROWS, always take the copy: a prompt's rows never depend on their step."""
    assert grouped_kernel_rows() < MIN_ROWS
    generator = torch.Generator().manual_seed(4)
    layer = Int4Linear(torch.randn(96, 64, generator=generator).bfloat16(), None)
    grouped = moe_int4.kernel_serves(torch.bfloat16, 32, 96, 64)
    assert (layer.grouped_blocks is not None) == grouped
    assert layer.kernel_rows == (grouped_kernel_rows() if grouped else layer.max_kernel_rows)
    kernel_rows = layer.kernel_rows
    attach_dense_copies([layer])
    packs = packing_applies(torch.device("cpu"), torch.bfloat16)
    assert (layer.dense is not None) == packs
    calls: list[int] = []
    if packs:
        layer.dense.register_forward_hook(lambda _, args, __: calls.append(args[0].shape[0]))
    for rows in range(1, kernel_rows + 2):
        x = torch.randn(rows, 64, generator=generator).bfloat16()
        expected = reference_product(layer, x)
        error = (layer(x).float() - expected).abs().max().item()
        assert error <= LAYER_TOLERANCE[torch.bfloat16] * expected.abs().max().item()
    assert calls == ([kernel_rows + 1] if packs else [])


@pytest.mark.parametrize(("method", "kernel_rows"), [("int8", 0), ("int4", FLOAT32_KERNEL_ROWS)])
def test_fp32_weight_only_layers_multiply_an_fp32_copy_above_their_fp32_kernel(
        method: str, kernel_rows: int) -> None:
    """torch's int8 kernel is slow in fp32: every step on the fp32 copy. int4 (groups of 32)
    has a kernel of ours for fp32 activations: steps of up to 15 tokens read the codes, below
    the rows a padded prompt step multiplies (so prompts always take the copy)."""
    assert FLOAT32_KERNEL_ROWS < MIN_ROWS_FP32
    assert Int4Linear(torch.randn(8, 64), None).serves_float32 == (load_int4_kernel() is not None)
    layer = LAYERS[method](torch.randn(96, 64), None)
    attach_dense_copies([layer])
    assert layer.kernel_rows == kernel_rows and layer.dense.weight.dtype == torch.float32
    calls: list[int] = []
    layer.dense.register_forward_hook(lambda _, args, __: calls.append(args[0].shape[0]))
    sizes = (1, FLOAT32_KERNEL_ROWS, FLOAT32_KERNEL_ROWS + 1)
    for rows in sizes:
        x = torch.randn(rows, 64)
        expected = reference_product(layer, x)
        assert (layer(x) - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    assert calls == [rows for rows in sizes if rows > kernel_rows]


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_fp32_kernel_equals_float_math_on_its_codes(group_size: int) -> None:
    """A GGUF's 4-bit codes in an fp32 model: groups of 32 run the C++ kernel (1-4 rows, codes
    packed two to a byte), other group sizes torch's; both float math on W = (q - 8)·s + z."""
    generator = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (80, 128), generator=generator, dtype=torch.uint8)
    scale = torch.rand(80, 128 // group_size, generator=generator) * 0.01
    zero = torch.randn(80, 128 // group_size, generator=generator) * 0.01
    bias = torch.randn(80, generator=generator)
    layer = Int4Linear.from_codes(q, scale, zero, bias, torch.float32)
    assert layer.serves_float32 == (group_size == 32)
    layer.finish_loading()
    assert torch.equal(layer.codes(), q)  # recovered from the kernel's packing
    weight = ((q.float() - 8) * scale.repeat_interleave(group_size, 1)
              + zero.repeat_interleave(group_size, 1))
    assert torch.equal(layer.dequantized_weight(), weight)
    for rows in (1, 2, 3, 4, 9, 70):
        x = torch.randn(rows, 128, generator=generator)
        expected = x @ weight.T + bias
        out = layer(x)
        assert out.shape == (rows, 80)
        assert (out - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_w4a8_kernel_quantizes_activations_as_the_reference_does() -> None:
    """The C++ kernel's own 8-bit codes and scales per group of 32 are the torch reference's
    bit for bit: a group of zeros, a group whose values tie at half a step, large and tiny
    values."""
    assert w4a8.load_w4a8_kernel() is not None
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(5, 160, generator=generator) * torch.rand(5, 1, generator=generator) * 40
    x[0, :32] = 0
    x[1, 32:64] = torch.arange(32) - 15.5  # halves of a step of 1: rounded to even
    x[1, 63] = 127
    x[2, 64:96] *= 1e-30
    x[3, 96:128] *= 2e4
    codes, scales = w4a8.kernel_quantize_groups(x)
    expected_codes, expected_scales = w4a8.quantize_groups(x)
    assert torch.equal(codes, expected_codes) and torch.equal(scales, expected_scales)
    assert torch.equal(scales[0, 0], torch.tensor(0.0)) and not codes[0, :32].any()
    assert codes.abs().max() == 127 and codes[1, 32:36].tolist() == [-16, -14, -14, -12]
    with pytest.raises(ValueError, match="groups of 32"):
        w4a8.kernel_quantize_groups(torch.randn(2, 48))


def test_w4a8_kernel_equals_float_math_on_its_codes_and_fake_quantized_inputs() -> None:
    """A GGUF's 4-bit codes with 8-bit activations: 1 to 15 rows read the codes (integer
    products per group), more the fp32 copy on the fake-quantized activations; both float
    math on W = (q - 8)·s + z and x's 8-bit stand-in."""
    generator = torch.Generator().manual_seed(7)
    q = torch.randint(0, 16, (84, 192), generator=generator, dtype=torch.uint8)
    scale = torch.rand(84, 6, generator=generator) * 0.01
    zero = torch.randn(84, 6, generator=generator) * 0.01
    bias = torch.randn(84, generator=generator)
    layer = Int4Linear.from_codes(q, scale, zero, bias, torch.float32, int8_activations=True)
    assert layer.method == "w4a8" and not layer.weight_only and layer.serves_float32
    attach_dense_copies([layer])
    assert layer.kernel_rows == FLOAT32_KERNEL_ROWS and torch.equal(layer.codes(), q)
    weight = layer.dequantized_weight().double()
    for rows in (1, 2, 3, 4, 5, 8, 15, 16, 40):
        x = torch.randn(rows, 192, generator=generator) * 5
        expected = w4a8.fake_quantize_groups(x).double() @ weight.T + bias.double()
        error = (layer(x).double() - expected).abs().max().item()
        assert error <= 1e-5 * expected.abs().max().item(), rows
        # Not the float activations' product: the 8-bit inputs are what it answers to.
        assert not torch.allclose(layer(x).double(), x.double() @ weight.T + bias.double(),
                                  rtol=0, atol=1e-5 * expected.abs().max().item())
    with pytest.raises(ValueError, match="w4a8"):
        w4a8.run_w4a8_matmul(torch.randn(2, 100), *layer._float_kernel_args)


@pytest.mark.parametrize("kind", ["int4", "int4-bf16", "w4a8", "q8_0", "q8_0-bf16"])
def test_the_code_kernels_give_a_row_the_same_bits_whatever_shares_the_call(kind: str) -> None:
    """Each output of our int4, w4a8 and Q8_0 kernels is one thread's sum in one order (w4a8's
    activations quantized row by row): a row alone,
    among 2..70 others at any position, and on 1 or 2 threads, gives the same bits (what
    batch-invariant serving needs of a product)."""
    generator = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16 if kind.endswith("bf16") else torch.float32
    if kind.startswith(("int4", "w4a8")):
        layer: QuantizedLinear = Int4Linear.from_codes(
            torch.randint(0, 16, (48, 320), generator=generator, dtype=torch.uint8),
            torch.rand(48, 10, generator=generator), torch.randn(48, 10, generator=generator),
            None, dtype, int8_activations=kind == "w4a8")
        assert layer.serves_float32 or dtype == torch.bfloat16
    else:
        layer = Q8_0Linear(torch.randint(-127, 128, (48, 320), generator=generator,
                                         dtype=torch.int8),
                           torch.rand(48, 10, generator=generator), None, dtype)
    row = torch.randn(1, 320, generator=generator).to(dtype)
    alone = layer.product(row)
    threads = torch.get_num_threads()
    try:
        for rows, position, thread_count in ((2, 1, 1), (5, 4, threads), (13, 6, 1), (70, 0, 2),
                                             (70, 69, threads)):
            batch = torch.randn(rows, 320, generator=generator).to(dtype)
            batch[position] = row[0]
            torch.set_num_threads(thread_count)
            assert torch.equal(layer.product(batch)[position], alone[0]), (rows, position)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("method", METHODS)
def test_bf16_model_on_the_kernels_stays_near_its_fp32_reference(method: str,
                                                                  tmp_path: Path) -> None:
    """The served bf16 path (kernels for small steps, packed copies for large ones where the
    CPU has native bf16) against the fp32 float math of the same dequantized weights."""
    hf_model = build_tiny_hf_model()
    hf_model.save_pretrained(tmp_path / "tiny")
    core = make_core(str(tmp_path / "tiny"), dtype="bfloat16", quantization=method)
    reference = dequantized_reference(hf_model, core.model, method)
    for length in (1, 3, 24):  # decode-sized steps run the int kernels
        prompt = [(7 * i + 3) % 250 + 3 for i in range(length)]
        ours = prefill_logits(core.model, prompt)
        with torch.no_grad():
            theirs = reference(torch.tensor([prompt])).logits[0]
        assert (ours - theirs).abs().max().item() < 0.1 * theirs.abs().max().item()


def test_int4_groups_must_divide_the_input_channels() -> None:
    with pytest.raises(ValueError, match="group size 48"):
        Int4Linear(torch.randn(8, 64), None, group_size=48)


def test_quantize_linears_replaces_every_linear_and_a_tied_head() -> None:
    from engine.models.config import ModelConfig
    from engine.models.llama import LlamaForCausalLM

    config = ModelConfig.from_hf(build_tiny_hf_model(tie_word_embeddings=True).config.to_dict())
    model = LlamaForCausalLM(config, dtype=torch.float32)
    made = quantize_linears(model, "int4", group_size=32)
    plain = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    assert all(name.endswith(".dense") for name in plain)  # fp32: each layer's float copy
    assert model.lm_head is made[-1] and isinstance(model.lm_head, Int4Linear)
    assert len(made) == 4 * config.num_hidden_layers + 1
    assert quantize_linears(model, "none") == []
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_linears(model, "int3")


def dequantized_reference(hf_model: nn.Module, engine_model: nn.Module, method: str):
    """The transformers model with the engine's dequantized weights (fused projections split
    back) and, for w8a8 and w4a8, every linear's input fake-quantized (per token, per 32)."""
    hf_layers = hf_model.model.layers
    for hf_layer, layer in zip(hf_layers, engine_model.model.layers, strict=True):
        attention, mlp = hf_layer.self_attn, hf_layer.mlp
        sizes = [attention.q_proj.out_features, attention.k_proj.out_features,
                 attention.v_proj.out_features]
        qkv = layer.self_attn.qkv_proj.dequantized_weight().split(sizes)
        for projection, weight in zip((attention.q_proj, attention.k_proj, attention.v_proj),
                                      qkv, strict=True):
            projection.weight.data.copy_(weight)
        attention.o_proj.weight.data.copy_(layer.self_attn.o_proj.dequantized_weight())
        gate, up = layer.mlp.gate_up_proj.dequantized_weight().chunk(2)
        mlp.gate_proj.weight.data.copy_(gate)
        mlp.up_proj.weight.data.copy_(up)
        mlp.down_proj.weight.data.copy_(layer.mlp.down_proj.dequantized_weight())
    hf_model.lm_head.weight.data.copy_(engine_model.lm_head.dequantized_weight())
    quantizes_activations = {"w8a8": W8A8Linear.fake_quantized_input,
                             "w4a8": w4a8.fake_quantize_groups}.get(method)
    if quantizes_activations is not None:
        for module in hf_model.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_pre_hook(
                    lambda _, args: (quantizes_activations(args[0]),))
    return hf_model


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("method", METHODS)
def test_served_quantized_equals_transformers_on_the_dequantized_weights(
        method: str, compiled: bool, tmp_path: Path) -> None:
    """The compiled forward calls the same quantized layers (`loom::linear`)."""
    hf_model = build_tiny_hf_model()
    model_dir = tmp_path / "tiny"
    hf_model.save_pretrained(model_dir)
    # 10 blocks of 16 tokens for 5 requests of up to 40 + 16 tokens: preemption is certain.
    core = make_core(str(model_dir), quantization=method, num_kv_blocks=10,
                     max_num_batched_tokens=32, compile=compiled)
    assert (core.runner.forward is not core.model) == compiled
    assert {module.method for module in core.model.modules()
            if isinstance(module, QuantizedLinear)} == {method}
    reference = dequantized_reference(hf_model, core.model, method)

    prompt = [(7 * i + 3) % 250 + 3 for i in range(24)]
    ours = prefill_logits(core.model, prompt)
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0]
    assert (ours - theirs).abs().max().item() < LOGIT_TOLERANCE[method]

    prompts = [[(11 * i + 5 * j) % 250 + 3 for j in range(n)]
               for i, n in enumerate([5, 40, 17, 29, 9])]
    batch = [greedy_request(p, max_tokens=16) for p in prompts]
    together = run_to_completion(core, batch)
    assert core.scheduler.num_preemptions >= 1
    assert_equals_transformers_generate(together, batch, reference)


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    from common.default_model import resolve_model

    return resolve_model(None)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_default_model_quantized_logits_match_its_dequantized_reference(
        smollm2_dir: str, method: str) -> None:
    """fp32, 30 layers: as tight as the float path's own parity with transformers."""
    from transformers import AutoModelForCausalLM

    ours = load_model(smollm2_dir, torch.float32, torch.device("cpu"), quantization=method)
    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    hf_model.lm_head.weight = nn.Parameter(hf_model.lm_head.weight.detach().clone())  # untie
    reference = dequantized_reference(hf_model, ours, method)
    logits = prefill_logits(ours, DEFAULT_MODEL_PROMPT)
    with torch.no_grad():
        expected = reference(torch.tensor([DEFAULT_MODEL_PROMPT])).logits[0]
    assert (logits - expected).abs().max().item() < 2e-3
    assert torch.equal(logits.argmax(dim=-1), expected.argmax(dim=-1))


@pytest.mark.parametrize("method", ["w8a8", "w4a8"])
def test_default_model_activation_quantized_layers_match_float_math_on_their_real_inputs(
        smollm2_dir: str, method: str) -> None:
    """SmolLM2's residual stream carries outliers of ~2e4, so one activation code's step is
    large and a 1e-7 difference upstream that moves a value across a rounding boundary moves
    the logits by whole units: whole-model parity with an independent implementation is
    chaotic when activations are quantized (their quality is bench.quality's business). So
    each such layer is checked on the activations it really receives, against its
    fake-quantized float math. w4a8 keeps the GGUF's own Q4_1 codes (the Q8_0 head stays
    weight-only); w8a8 quantizes the float weights."""
    ours = load_model(smollm2_dir, torch.float32, torch.device("cpu"), quantization=method)
    worst: list[float] = []

    def checked(layer: QuantizedLinear) -> Callable[[torch.Tensor], torch.Tensor]:
        forward = layer.forward

        def check(x: torch.Tensor) -> torch.Tensor:
            out = forward(x)
            expected = reference_product(layer, x)
            worst.append((out - expected).abs().max().item() / expected.abs().max().item())
            return out
        return check

    # The model calls its layers' `forward` (no hooks: see DecoderLayer), so wrap that.
    layers = [module for module in ours.modules()
              if isinstance(module, QuantizedLinear) and module.method == method]
    for layer in layers:
        layer.forward = checked(layer)
    assert len(layers) == 4 * 30 + (method == "w8a8")
    for prompt in (DEFAULT_MODEL_PROMPT * 2, DEFAULT_MODEL_PROMPT[:3]):  # the copy, the kernel
        prefill_logits(ours, prompt)
    assert len(worst) == 2 * len(layers)
    assert max(worst) < 1e-5


DEFAULT_MODEL_PROMPT = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 11741, 314]


def test_the_tiled_q8_0_kernel_equals_float_math_and_a_rows_sum_is_its_own() -> None:
    """bf16 on a CPU that multiplies bf16 pairs: codes held in tiles of 16 channels (70
    channels: the last tile padded), 1-13 rows each equal float math on the dequantized
    weight, and from 3 to tiled_kernel_rows rows a row's result is the same whatever rows
    share its step (one and two rows take fp32 products)."""
    generator = torch.Generator().manual_seed(3)
    codes = torch.randint(-128, 128, (70, 96), generator=generator, dtype=torch.int8)
    scales = torch.rand(70, 3, generator=generator) * 0.01
    layer = Q8_0Linear(codes, scales, None, torch.bfloat16)
    assert layer.tiled == tiles_serve(torch.device("cpu"), torch.bfloat16)
    if not layer.tiled:
        assert layer.kernel_rows == Q8_0Linear.max_kernel_rows
        return
    assert layer.kernel_rows == Q8_0Linear.tiled_kernel_rows
    assert not layer.serves_float32  # its one- and two-row sums differ from three rows' and up
    weight = (codes.float().view(70, -1, 32) * scales[..., None]).view(70, 96)
    assert torch.equal(layer.dequantized_weight(), weight)
    x = torch.randn(13, 96, generator=generator).bfloat16()
    for rows in range(1, 14):
        expected = x[:rows].float() @ weight.T
        out = layer(x[:rows]).float()
        assert (out - expected).abs().max().item() <= 2**-7 * expected.abs().max().item()
    last_three = layer(x[9:12])
    for first in range(0, 9):
        assert torch.equal(layer(x[first:12])[-3:], last_three)
