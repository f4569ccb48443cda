"""The elementwise layers' C++ kernels (`forward_cpu`) against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.elementwise import load_elementwise
from engine.layers.activation import SiluAndMul
from engine.layers.custom_op import Implementation
from engine.layers.norm import RMSNorm
from engine.layers.rotary import Rotary

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def kernels_built() -> None:
    assert load_elementwise() is not None, "the C++ elementwise kernels did not build"


def norm_of(weight: torch.Tensor, eps: float, implementation: Implementation) -> RMSNorm:
    norm = RMSNorm(weight.shape[0], eps, weight.dtype)
    norm.weight.data.copy_(weight)
    norm.use(implementation)
    return norm


def layer(op: SiluAndMul | Rotary, implementation: Implementation) -> SiluAndMul | Rotary:
    op.use(implementation)
    return op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 200])  # 200 rows of 576 run on several threads
@pytest.mark.parametrize("hidden", [576, 100])  # 100: a row ending inside a 16-lane vector
def test_rms_norm_and_the_fused_residual_add(dtype: torch.dtype, rows: int, hidden: int) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, hidden, dtype=dtype) * 3
    residual = torch.randn(rows, hidden, dtype=dtype)
    weight = 1 + 0.1 * torch.randn(hidden, dtype=dtype)
    tolerance = TOLERANCES[dtype]

    want = F.rms_norm(x.float(), (hidden,), weight.float(), 1e-5)
    norm = norm_of(weight, 1e-5, "cpu")
    got = norm(x)
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)

    want_sum = (x + residual).float()  # rounded to dtype as the unfused add stores it
    want = F.rms_norm(want_sum, (hidden,), weight.float(), 1e-5)
    normed, summed = norm(x.clone(), residual.clone())
    torch.testing.assert_close(summed.float(), want_sum, atol=0, rtol=0)
    torch.testing.assert_close(normed.float(), want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("width", [1536, 40])
def test_silu_and_mul(dtype: torch.dtype, rows: int, width: int) -> None:
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * width, dtype=dtype) * 4
    gate_up[0, :6] = torch.tensor([0.0, -100.0, 100.0, -87.5, 88.5, 1e-8], dtype=dtype)
    gate, up = gate_up.float().split(width, dim=-1)
    want = F.silu(gate) * up
    got = layer(SiluAndMul(), "cpu")(gate_up)
    assert got.shape == (rows, width) and got.dtype == dtype
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


def test_the_native_implementations_are_the_torch_ops() -> None:
    x, residual, weight = torch.randn(4, 8), torch.randn(4, 8), torch.rand(8) + 0.5
    normed, summed = norm_of(weight, 1e-6, "native")(x, residual)
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(normed, F.rms_norm(x + residual, (8,), weight, 1e-6))
    torch.testing.assert_close(layer(SiluAndMul(), "native")(torch.cat((x, residual), -1)),
                               F.silu(x) * residual)


def torch_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin, in float32."""
    half = x.shape[-1] // 2
    x, cos, sin = x.float(), cos.float(), signed_sin.float()[..., half:]
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * torch.cat((sin, sin), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 300])
@pytest.mark.parametrize("dim", [64, 40])  # 40: each half ends inside a 16-lane vector
def test_rotary_rotates_the_q_and_k_slices_of_a_fused_qkv_row_in_place(
    dtype: torch.dtype, tokens: int, dim: int,
) -> None:
    torch.manual_seed(tokens)
    heads, kv_heads = 9, 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    angles = torch.rand(tokens, 1, dim // 2) * 6.0
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    signed_sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)
    qk = qkv[:, :(heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    want = torch_rotary(qk, cos, signed_sin)
    got = layer(Rotary(), "cpu")(qk, cos, signed_sin)
    assert got.data_ptr() == qk.data_ptr(), "rotated in place"
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before), "v is left alone"
