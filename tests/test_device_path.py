"""The engine on the device named by LOOM_TEST_DEVICE (default `cpu`): what bench/gpu_check.sh
runs on a GPU (LOOM_TEST_DEVICE=cuda), and CI runs here on the CPU, so the check's code path
is exercised on every commit.

- Logits of a prefill through the engine's model equal transformers' on the same device and
  weights: fp32 within 1e-4; bf16 within 3% of the largest logit (both round differently).
- The engine oracle: greedy outputs of a mixed batch with chunked prefill and forced
  preemption equal transformers' `generate` (fp32, near ties excused), no leaked blocks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.engine_helpers import (
    assert_equals_transformers_generate,
    greedy_request,
    make_core,
    run_to_completion,
)
from tests.model_fixtures import (
    allocate_kv_caches,
    build_tiny_hf_model,
    contiguous_metadata,
    model_step,
)

DEVICE = torch.device(os.environ.get("LOOM_TEST_DEVICE", "cpu"))
BLOCK_SIZE = 16
LOGIT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def prefill_logits_on(core, prompt: list[int]) -> torch.Tensor:
    """Last-position float32 logits of one prefill through the engine's model, on its device
    and in its dtype, over a paged cache of its own."""
    blocks = -(-len(prompt) // BLOCK_SIZE)
    kv_caches = allocate_kv_caches(core.model, blocks, BLOCK_SIZE, core.dtype, core.device)
    metadata = contiguous_metadata([len(prompt)], [len(prompt)], BLOCK_SIZE, blocks,
                                   core.device)
    with torch.no_grad(), model_step(core.model, metadata, BLOCK_SIZE):
        hidden = core.model(torch.tensor(prompt, device=core.device),
                            torch.arange(len(prompt), device=core.device), kv_caches)
        return core.model.compute_logits(hidden[-1:])[0].cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_logits_on_the_device_match_transformers(dtype: torch.dtype,
                                                         tmp_path: Path) -> None:
    hf_model = build_tiny_hf_model()
    hf_model.save_pretrained(tmp_path / "tiny")
    core = make_core(str(tmp_path / "tiny"), device=DEVICE.type, num_kv_blocks=4,
                     dtype=str(dtype).split(".")[1])
    assert core.device.type == DEVICE.type
    prompt = [(7 * i + 3) % 250 + 3 for i in range(40)]
    reference = hf_model.to(DEVICE, dtype).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([prompt], device=DEVICE)).logits[0, -1].float().cpu()
    ours = prefill_logits_on(core, prompt)
    scale = 1.0 if dtype == torch.float32 else expected.abs().max().item()
    assert (ours - expected).abs().max().item() < LOGIT_TOLERANCE[dtype] * scale


def test_engine_on_the_device_equals_transformers_generate(tmp_path: Path) -> None:
    hf_model = build_tiny_hf_model()
    hf_model.save_pretrained(tmp_path / "tiny")
    # 10 blocks of 16 tokens for 5 requests of up to 40 + 16 tokens: preemption is certain;
    # 32 tokens a step: the longer prompts prefill in chunks.
    core = make_core(str(tmp_path / "tiny"), device=DEVICE.type, num_kv_blocks=10,
                     max_num_batched_tokens=32)
    prompts = [[(11 * i + 5 * j) % 250 + 3 for j in range(n)]
               for i, n in enumerate([5, 40, 17, 29, 9])]
    batch = [greedy_request(p, max_tokens=16) for p in prompts]
    outputs = run_to_completion(core, batch)
    assert core.scheduler.num_preemptions >= 1
    assert_equals_transformers_generate(outputs, batch, hf_model.eval())
