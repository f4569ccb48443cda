"""Decode steps replayed from recorded graphs (engine.executor.cuda_graphs) against eager steps,
on the
device named by LOOM_TEST_DEVICE (default `cpu`).

On a GPU (bench/gpu_check.sh) these record real CUDA graphs. On the CPU, `EagerReplay` runs
the recorded step again over the same persistent buffers, through Triton's interpreter (the
attention path a recorded step takes): everything but the recording itself is checked on
every commit, namely bucket padding, the reserved padding block, and that a replayed step
reads nothing but its buffers (a step that read a per-step Python value would replay the
recording's, and its tokens would differ from the eager engine's).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is an optional dependency (pip install .[gpu])")

from engine.executor.cuda_graphs import (
    CudaGraphRecorder,
    EagerReplay,
    Recorder,
    bucket_for,
    graph_batch_sizes,
)
from tests.engine_helpers import (
    assert_equals_transformers_generate,
    greedy_request,
    make_core,
    run_to_completion,
)
from tests.model_fixtures import build_tiny_hf_model

DEVICE = torch.device(os.environ.get("LOOM_TEST_DEVICE", "cpu"))


def recorder() -> Recorder:
    return CudaGraphRecorder(DEVICE) if DEVICE.type == "cuda" else EagerReplay()


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 64, 100, 256, 1024])
def test_every_decode_batch_up_to_the_largest_bucket_has_a_graph(max_num_seqs: int) -> None:
    sizes = graph_batch_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1
    assert sizes[-1] == min(max_num_seqs, 256)
    for batch in range(1, sizes[-1] + 1):
        bucket = bucket_for(sizes, batch)
        assert bucket >= batch and bucket in sizes
        assert all(size < batch for size in sizes if size < bucket)
    with pytest.raises(ValueError, match="no decode graph"):
        bucket_for(sizes, sizes[-1] + 1)


# The Triton kernel the graphs replay, plain and with Gemma 2's 12-token windows and caps.
GRAPH_MODELS = {"llama": ("llama", {}), "gemma2": ("gemma2", {
    "head_dim": 16, "num_hidden_layers": 2, "sliding_window": 12, "query_pre_attn_scalar": 16,
    "attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0, "tie_word_embeddings": True})}


@pytest.fixture(scope="module", params=list(GRAPH_MODELS))
def tiny(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module]:
    model_type, overrides = GRAPH_MODELS[request.param]
    hf_model = build_tiny_hf_model(model_type, **overrides)
    model_dir = tmp_path_factory.mktemp("graphs") / "tiny"
    hf_model.save_pretrained(model_dir)
    return str(model_dir), hf_model


def test_recording_writes_only_the_padding_block(tiny: tuple[str, torch.nn.Module]) -> None:
    core = make_core(tiny[0], device=DEVICE.type, num_kv_blocks=6, max_num_seqs=4,
                     recorder=recorder())
    padding_block = core.block_manager.num_blocks
    assert core.runner.graphs is not None and core.runner.graphs.sizes == [1, 2, 4]
    for k_cache, v_cache in core.runner.kv_caches:
        assert k_cache.shape[0] == padding_block + 1  # the scheduler never hands it out
        assert not k_cache[:padding_block].any() and not v_cache[:padding_block].any()
        assert k_cache[padding_block].any()


def test_replayed_decode_steps_equal_the_eager_engine(tiny: tuple[str, torch.nn.Module]) -> None:
    """Five requests in 10 blocks (preemption certain), 32 tokens a step (chunked prefill):
    decode batches of 5, 4, 3, ... replay the graphs of 8, 4, 4, ... rows."""
    model_dir, hf_model = tiny
    prompts = [[(11 * i + 5 * j) % 250 + 3 for j in range(n)]
               for i, n in enumerate([5, 40, 17, 29, 9])]
    settings = {"device": DEVICE.type, "num_kv_blocks": 10, "max_num_batched_tokens": 32}
    eager = make_core(model_dir, **settings, enforce_eager=True)
    expected = run_to_completion(eager, [greedy_request(p, max_tokens=16, request_id=str(i))
                                         for i, p in enumerate(prompts)])
    graphed = make_core(model_dir, **settings, max_num_seqs=8, recorder=recorder())
    graphs = graphed.runner.graphs
    assert graphs is not None
    replayed: list[int] = []
    run = graphs.run

    def counting_run(token_ids: list[int], *args: list) -> torch.Tensor:
        replayed.append(len(token_ids))
        return run(token_ids, *args)

    graphs.run = counting_run  # type: ignore[method-assign]
    batch = [greedy_request(p, max_tokens=16, request_id=str(i)) for i, p in enumerate(prompts)]
    outputs = run_to_completion(graphed, batch)
    assert graphed.scheduler.num_preemptions >= 1
    assert {bucket_for(graphs.sizes, n) for n in replayed} - set(replayed), "no padded batch"
    assert outputs == expected
    assert_equals_transformers_generate(outputs, batch, hf_model.eval())
