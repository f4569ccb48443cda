"""What w8a8 can gain over bf16 in one step's GEMMs, layer by layer, on this CPU.

    python -m bench.gemm_rates [--model DIR] [--rows 64] [--repeats 50]

Loads the model twice, bf16 (`--quantization none`: oneDNN-packed weights) and w8a8, and
times each distinct linear of one decoder layer and the output projection on `--rows` random
rows: the whole w8a8 layer (activation quantization, `torch._int_mm`, rescale) and
`_int_mm` alone. Per step, each layer linear counts once per decoder layer. The last line is
Amdahl's bound: with R ms of the step outside these GEMMs (attention, norms, sampling,
Python; see bench.profile_step), w8a8's step is (G_bf16 + R) / (G_w8a8 + R) times faster,
so a target ratio T holds only while R <= (G_bf16 - T * G_w8a8) / (T - 1).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from bench.attention import median_ms
from common.default_model import resolve_model
from engine.kernels.w8a8 import quantize_rows
from engine.platform.cpu import kernel_flags
from engine.quantization.w8a8 import W8A8Linear
from engine.weights.loader import load_model


def step_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, int]]:
    """(name, module, times per step): layer 0's linears, each once per layer, and the head."""
    layers = model.model.layers
    named = [(f"layers.*.{name}", module, len(layers))
             for name, module in layers[0].named_modules()
             if hasattr(module, "in_features") and not list(module.children())]
    return [*named, ("lm_head", model.lm_head, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gemm_rates", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--target", type=float, default=1.5)
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    cpu = torch.device("cpu")
    bf16 = step_linears(load_model(model_dir, torch.bfloat16, cpu, quantization="none"))
    w8a8 = step_linears(load_model(model_dir, torch.bfloat16, cpu, quantization="w8a8"))
    print(f"flags: {kernel_flags()}; torch {torch.__version__}; {torch.get_num_threads()} "
          f"threads; {args.rows} rows; median of {args.repeats}\n")
    print("| linear | K -> N | per step | bf16 µs | w8a8 layer µs | `_int_mm` µs | ratio |")
    print("|---|---|--:|--:|--:|--:|--:|")
    total_bf16 = total_w8a8 = 0.0
    for (name, dense, count), (_, quantized, _) in zip(bf16, w8a8, strict=True):
        assert isinstance(quantized, W8A8Linear)
        x = torch.randn(args.rows, dense.in_features, dtype=torch.bfloat16)
        a, _ = quantize_rows(x)
        dense_us = median_ms(partial(dense, x), args.repeats) * 1e3
        layer_us = median_ms(partial(quantized, x), args.repeats) * 1e3
        int_mm_us = median_ms(partial(torch._int_mm, a, quantized.qweight_t), args.repeats) * 1e3
        total_bf16 += count * dense_us
        total_w8a8 += count * layer_us
        print(f"| {name} | {dense.in_features} -> {dense.out_features} | {count} | "
              f"{dense_us:.0f} | {layer_us:.0f} | {int_mm_us:.0f} | {dense_us / layer_us:.2f} |")
    bound = (total_bf16 - args.target * total_w8a8) / (args.target - 1) / 1e3
    print(f"\nper step: bf16 {total_bf16 / 1e3:.1f} ms, w8a8 {total_w8a8 / 1e3:.1f} ms "
          f"({total_bf16 / total_w8a8:.2f}x); a {args.target:g}x faster step needs the rest "
          f"of the step at most {bound:.1f} ms")


if __name__ == "__main__":
    main()
