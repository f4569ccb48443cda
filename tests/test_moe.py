"""The routed-experts layer: grouped by expert it computes what a per-token loop computes, and
with its experts packed or quantized it answers to float math on their own weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.moe_int4 import (
    combine_experts,
    group_by_expert,
    kernel_serves,
    pack_experts,
    run_moe_int4,
    unpack_experts,
)
from engine.layers.moe import EachExpert, FusedMoE
from engine.quantization.int4 import Int4Linear
from engine.quantization.int4_experts import Int4Experts
from engine.quantization.int8 import Int8Linear
from engine.quantization.registry import attach_dense_copies
from engine.quantization.unquantized import PackedLinear, packing_applies, prepack_linears

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 64, 32, 6, 2


def random_moe(dtype: torch.dtype = torch.float32, renormalize: bool = True) -> FusedMoE:
    torch.manual_seed(0)
    moe = FusedMoE(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, renormalize,
                   ("gate_proj", "up_proj", "down_proj"), dtype)
    for param in moe.parameters():
        param.data.copy_(torch.randn(param.shape) * 0.2)
    return moe


def per_token(moe: FusedMoE, x: torch.Tensor,
              weights_of: tuple[list[torch.Tensor], list[torch.Tensor]]) -> torch.Tensor:
    """The obvious loop: each token, each of its experts, one at a time, in float32."""
    gate_up, down = weights_of
    weights, experts = moe.route(x)
    weights = weights.float()
    out = torch.zeros(x.shape, dtype=torch.float32)
    for token in range(x.shape[0]):
        for weight, expert in zip(weights[token], experts[token], strict=True):
            gate, up = F.linear(x[token].float(), gate_up[expert]).chunk(2)
            out[token] += weight * F.linear(F.silu(gate) * up, down[expert])
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_equals_the_per_token_loop(renormalize: bool) -> None:
    moe = random_moe(renormalize=renormalize)
    x = torch.randn(37, HIDDEN)
    weights = ([moe.w13[e] for e in range(EXPERTS)], [moe.w2[e] for e in range(EXPERTS)])
    with torch.inference_mode():
        torch.testing.assert_close(moe(x), per_token(moe, x, weights), atol=1e-5, rtol=1e-5)


def dequantized_experts(moe: FusedMoE) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every expert's (gate/up, down) weights as the layer holds them, in float32."""
    assert moe.projections is not None
    return tuple([projection.dequantized_weight(e) if isinstance(projection, Int4Experts)
                  else projection.layers[e].dequantized_weight() for e in range(EXPERTS)]
                 for projection in moe.projections)


@pytest.mark.parametrize("make, grouped", [(Int8Linear, False), (Int4Linear, False),
                                           (Int4Linear, True)],
                         ids=["int8", "int4-per-expert", "int4-grouped"])
def test_quantized_experts_answer_to_their_dequantized_weights(
        make: type, grouped: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if grouped and not moe_int4_kernel_serves():
        pytest.skip("the grouped int4 kernel needs AVX512-BF16")
    if not grouped:
        monkeypatch.setattr(Int4Experts, "serve", staticmethod(lambda layers: False))
    moe = random_moe(torch.bfloat16)
    own = [make(weight, None).dequantized_weight() for weight in (*moe.w13, *moe.w2)]
    made = moe.replace_products(make)
    attach_dense_copies(made)
    assert moe.w13 is None and moe.projections is not None
    assert all(isinstance(projection, Int4Experts if grouped else EachExpert)
               for projection in moe.projections)
    assert len(made) == (0 if grouped else 2 * EXPERTS)
    assert all(layer.dense is None for layer in made)  # no dense copy beside the codes
    dequantized = dequantized_experts(moe)
    for expert in range(EXPERTS):  # grouping keeps each expert's own codes, scales and zeros
        assert torch.equal(dequantized[0][expert], own[expert])
        assert torch.equal(dequantized[1][expert], own[EXPERTS + expert])
    for rows in (1, 3, 40, 300):  # per expert: decode-sized groups, many rows
        x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16)
        with torch.inference_mode():
            got = moe(x).float()
        want = per_token(moe, x, dequantized)
        assert (got - want).abs().max().item() < 0.05 * want.abs().max().item() + 1e-2


def moe_int4_kernel_serves() -> bool:
    return kernel_serves(torch.bfloat16, 32, 16, 32)


def random_packed_experts(experts: int, n: int, k: int,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scales_and_zeros) of random 4-bit experts and the kernel's layout of them."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (experts, n, k), dtype=torch.uint8, generator=generator)
    scale = torch.rand(experts, k // 32, n, generator=generator) * 0.1 + 0.01
    zero = torch.randn(experts, k // 32, n, generator=generator) * 0.1
    scales_and_zeros = torch.stack([scale, zero], dim=-1).bfloat16()
    return q, scales_and_zeros, pack_experts(q, scales_and_zeros)


def test_grouped_int4_kernel_is_float_math_on_the_codes_and_rows_keep_their_bits() -> None:
    if not moe_int4_kernel_serves():
        pytest.skip("the grouped int4 kernel needs AVX512-BF16")
    experts, n, k = 6, 96, 128  # 6 tiles: spans of 4, 2 and 1 tiles
    q, scales_and_zeros, blocks = random_packed_experts(experts, n, k)
    unpacked = unpack_experts(blocks)
    assert torch.equal(unpacked[0], q) and torch.equal(unpacked[1], scales_and_zeros)
    counts = torch.tensor([1, 0, 2, 3, 9, 20])  # every rows-per-call template, > 8 in blocks
    starts = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
    x = torch.randn(int(counts.sum()), k).bfloat16()
    y = run_moe_int4(x, counts, blocks)
    scale, zero = (part.transpose(1, 2).repeat_interleave(32, 2)
                   for part in scales_and_zeros.float().unbind(-1))
    weights = (q.float() - 8) * scale + zero
    for expert in range(experts):
        rows = slice(int(starts[expert]), int(starts[expert + 1]))
        want = x[rows].float() @ weights[expert].T
        # bf16 output: at most half a unit in the last place, plus fp32 sums' noise
        assert ((y[rows].float() - want).abs() <= want.abs() * 2 ** -8 + 1e-3).all()
        alone = torch.zeros(experts, dtype=torch.int64)
        alone[expert] = rows.stop - rows.start
        for row in range(rows.start, rows.stop):
            one = torch.zeros(experts, dtype=torch.int64)
            one[expert] = 1
            assert torch.equal(run_moe_int4(x[row:row + 1], one, blocks), y[row:row + 1])
        assert torch.equal(run_moe_int4(x[rows], alone, blocks), y[rows])


def test_experts_are_packed_where_linears_are_and_compute_the_same() -> None:
    holder = torch.nn.Module()
    holder.moe = random_moe(torch.bfloat16)
    x = torch.randn(9, HIDDEN, dtype=torch.bfloat16)
    with torch.inference_mode():
        plain = holder.moe(x)
        packed = prepack_linears(holder, torch.device("cpu"), torch.bfloat16)
        if not packing_applies(torch.device("cpu"), torch.bfloat16):
            assert packed == 0 and holder.moe.projections is None
            return
        assert packed == 2 * EXPERTS
        assert isinstance(holder.moe.projections[0].layers[0], PackedLinear)
        assert holder.moe.replace_products(PackedLinear) == []  # once
        torch.testing.assert_close(holder.moe(x), plain, atol=2e-2, rtol=2e-2)


def test_rows_are_grouped_by_expert_in_token_order_and_summed_back() -> None:
    if not moe_int4_kernel_serves():
        pytest.skip("the grouped int4 kernel needs AVX512-BF16")
    generator = torch.Generator().manual_seed(2)
    tokens, k, experts, hidden = 13, 3, 5, 48
    chosen = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)])
    x = torch.randn(tokens, hidden, generator=generator).bfloat16()
    grouped, counts, rows = group_by_expert(x, chosen, experts)
    order = chosen.flatten().argsort(stable=True)  # what the layer's torch path does
    assert torch.equal(counts, torch.bincount(chosen.flatten(), minlength=experts))
    assert torch.equal(grouped, x[order // k])
    assert torch.equal(rows.flatten()[order], torch.arange(tokens * k))
    weights = torch.rand(tokens, k, generator=generator)
    out = torch.randn(tokens * k, hidden, generator=generator).bfloat16()
    summed = combine_experts(out, rows, weights)
    want = (out[rows].float() * weights[..., None]).sum(dim=1)
    assert ((summed.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-5).all()
    alone = combine_experts(out, rows[4:5], weights[4:5])  # a token's sum is its own pairs'
    assert torch.equal(alone, summed[4:5])
    with pytest.raises(ValueError, match="an expert outside"):
        group_by_expert(x, chosen.masked_fill(chosen == 0, experts), experts)
