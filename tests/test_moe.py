"""The routed-experts layer: grouped by expert it computes what a per-token loop computes, and
with its experts packed or quantized it answers to float math on their own weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers.moe import FusedMoE
from engine.quantization.int4 import Int4Linear
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


@pytest.mark.parametrize("make", [Int8Linear, Int4Linear], ids=["int8", "int4"])
def test_quantized_experts_answer_to_their_dequantized_weights(make: type) -> None:
    moe = random_moe(torch.bfloat16)
    made = moe.replace_products(make)
    attach_dense_copies(made)
    assert moe.w13 is None and len(made) == 2 * EXPERTS
    dequantized = ([made[2 * e].dequantized_weight() for e in range(EXPERTS)],
                   [made[2 * e + 1].dequantized_weight() for e in range(EXPERTS)])
    for rows in (1, 3, 40):  # decode-sized groups run the int kernels, larger the dense copy
        x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16)
        with torch.inference_mode():
            got = moe(x).float()
        want = per_token(moe, x, dequantized)
        assert (got - want).abs().max().item() < 0.05 * want.abs().max().item() + 1e-2


def test_experts_are_packed_where_linears_are_and_compute_the_same() -> None:
    holder = torch.nn.Module()
    holder.moe = random_moe(torch.bfloat16)
    x = torch.randn(9, HIDDEN, dtype=torch.bfloat16)
    with torch.inference_mode():
        plain = holder.moe(x)
        packed = prepack_linears(holder, torch.device("cpu"), torch.bfloat16)
        if not packing_applies(torch.device("cpu"), torch.bfloat16):
            assert packed == 0 and holder.moe.products is None
            return
        assert packed == 2 * EXPERTS and isinstance(holder.moe.products[0], PackedLinear)
        assert holder.moe.replace_products(PackedLinear) == []  # once
        torch.testing.assert_close(holder.moe(x), plain, atol=2e-2, rtol=2e-2)
