"""A mixture-of-experts decode step against a dense model with as many active parameters.

    python -m bench.moe_step [--batch 1,32] [--context 128] [--steps 20] [--rounds 3]
        [--dtype auto] [--quantization none]

Both models are random-weight and built in memory (no checkpoint): a Qwen3-MoE shape of ~1B
parameters with ~0.2B active per token (32 experts of 768 columns, 4 per token, 12 layers,
hidden 1024), and a Qwen3 shape whose dense MLP is as wide as four experts (~0.2B). Each
figure is the median wall time of `--steps` decode steps of `batch` requests at `context`
tokens, through the engine's ModelRunner (routing, grouping, the GEMMs, attention); the two
models take turns, `--rounds` times, so that a noisy machine's drift falls on both.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from engine.executor.model_runner import ModelRunner, StepInputs
from engine.models.config import ModelConfig
from engine.models.registry import model_class
from engine.platform.cpu import choose_dtype, kernel_flags
from engine.quantization.registry import quantize_linears
from engine.quantization.unquantized import prepack_linears
from engine.weights.targets import materialize

BLOCK_SIZE = 16
COMMON: dict[str, Any] = {
    "hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "tie_word_embeddings": False,
}
SHAPES: dict[str, dict[str, Any]] = {
    "moe": {**COMMON, "model_type": "qwen3_moe", "intermediate_size": 3072,
            "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 768,
            "norm_topk_prob": True},
    "dense": {**COMMON, "model_type": "qwen3", "intermediate_size": 4 * 768},
}


def build(shape: dict[str, Any], dtype: torch.dtype, quantization: str) -> torch.nn.Module:
    config = ModelConfig.from_hf(shape)
    with torch.device("meta"):
        model = model_class(config.model_type)(config, dtype)
    materialize(model, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    model = model.eval()
    quantize_linears(model, quantization)
    prepack_linears(model, torch.device("cpu"), dtype)
    return model


def parameters(shape: dict[str, Any]) -> tuple[float, float]:
    """(total, active per token) parameters in billions."""
    config = ModelConfig.from_hf(shape)
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads
    attention = hidden * (2 * heads + 2 * kv * config.head_dim)
    embeddings = 2 * config.vocab_size * hidden
    moe = config.moe
    if moe is None:
        mlp_total = mlp_active = 3 * hidden * config.intermediate_size
    else:
        expert = 3 * hidden * moe.intermediate_size
        mlp_total, mlp_active = expert * moe.num_experts, expert * moe.top_k
    total = embeddings + layers * (attention + mlp_total)
    active = embeddings + layers * (attention + mlp_active)
    return total / 1e9, active / 1e9


def decode_ms(model: torch.nn.Module, dtype: torch.dtype, batch: int, context: int,
              steps: int) -> float:
    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
    runner = ModelRunner(model, batch * blocks_per_seq, BLOCK_SIZE, torch.device("cpu"), dtype)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    rng = random.Random(0)
    times = []
    for step in range(steps + 2):  # two warm-up steps
        inputs = StepInputs(
            token_ids=[rng.randrange(32000) for _ in range(batch)],
            positions=[context] * batch,
            slot_mappings=[[table[context // BLOCK_SIZE] * BLOCK_SIZE + context % BLOCK_SIZE
                            for table in tables]],
            query_lens=[1] * batch, seq_lens=[context + 1] * batch, block_tables=[tables],
            sample_rows=list(range(batch)))
        started = time.perf_counter()
        runner.run(inputs)
        if step >= 2:
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3,
                        help="the two models measured alternately, this many times each")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none")
    args = parser.parse_args()
    dtype = choose_dtype(args.dtype, torch.device("cpu"))
    batches = [int(b) for b in args.batch.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU flags "
          f"{kernel_flags()}, {dtype}, quantization {args.quantization}, context "
          f"{args.context}; decode step ms (median of {args.steps} steps, then of "
          f"{args.rounds} alternating rounds)")
    models = {name: build(shape, dtype, args.quantization) for name, shape in SHAPES.items()}
    rounds: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for batch in batches:
            for name, model in models.items():
                rounds.setdefault((name, batch), []).append(
                    decode_ms(model, dtype, batch, args.context, args.steps))
    figures = {key: statistics.median(values) for key, values in rounds.items()}
    for name, shape in SHAPES.items():
        total, active = parameters(shape)
        print(f"{name:6} {total:.2f}B total, {active:.2f}B active: " + ", ".join(
            f"batch {batch} {figures[name, batch]:.1f} ("
            + " / ".join(f"{ms:.1f}" for ms in rounds[name, batch]) + ")" for batch in batches))
    print("moe / dense: " + ", ".join(
        f"batch {batch} {figures['moe', batch] / figures['dense', batch]:.2f}x"
        for batch in batches))


if __name__ == "__main__":
    main()
