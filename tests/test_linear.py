"""Prepacked linear layers compute what the plain ones compute."""

from __future__ import annotations

import torch
from torch import nn

from engine.quantization.unquantized import PackedLinear, packing_applies, prepack_linears
from engine.weights.loader import load_model
from tests.model_fixtures import build_tiny_llama_dir

CPU = torch.device("cpu")


def test_packing_is_chosen_only_for_bf16_on_a_cpu_with_native_bf16() -> None:
    assert not packing_applies(CPU, torch.float32)
    assert not packing_applies(torch.device("cuda"), torch.bfloat16)
    model = nn.Sequential(nn.Linear(8, 4, dtype=torch.float32))
    assert prepack_linears(model, CPU, torch.float32) == 0
    assert type(model[0]) is nn.Linear


def test_packed_linear_matches_f_linear_in_bf16() -> None:
    if not packing_applies(CPU, torch.bfloat16):
        model = nn.Sequential(nn.Linear(8, 4, dtype=torch.bfloat16))
        assert prepack_linears(model, CPU, torch.bfloat16) == 0, "packed without native bf16"
        return
    torch.manual_seed(0)
    for bias in (False, True):
        linear = nn.Linear(576, 960, bias=bias, dtype=torch.bfloat16)
        packed = PackedLinear(linear.weight, linear.bias)
        for rows in (1, 7, 64):
            x = torch.randn(rows, 576, dtype=torch.bfloat16)
            with torch.inference_mode():
                torch.testing.assert_close(packed(x), linear(x), rtol=1e-2, atol=1e-2)


def test_a_packed_bf16_model_gives_the_plain_models_logits(tmp_path, monkeypatch) -> None:
    model_dir = build_tiny_llama_dir(tmp_path, tie_word_embeddings=True)
    packed = load_model(model_dir, torch.bfloat16, CPU)
    monkeypatch.setattr("engine.weights.loader.prepack_linears", lambda *args: 0)
    plain = load_model(model_dir, torch.bfloat16, CPU)
    linears = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    if not packing_applies(CPU, torch.bfloat16):
        assert not linears
        return
    assert len(linears) == 4 * 2 + 1  # qkv, o, gate_up, down per layer + the tied lm_head
    hidden = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(packed.compute_logits(hidden), plain.compute_logits(hidden),
                                   rtol=2e-2, atol=2e-2)
