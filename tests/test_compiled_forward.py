"""The torch.compile'd forward answers to the eager one and compiles only at warm-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from torch._dynamo.utils import counters

from bench.launched import REPO_ROOT
from common.default_model import default_cache_dir
from engine.executor.model_runner import ModelRunner
from engine.weights.loader import load_model
from tests.model_fixtures import build_metadata, build_tiny_llama_dir, model_step, positions_for

BLOCK_SIZE = 4
HEAD_DIM = 16  # the tiny model's: a batch of 16 tokens must not share its symbol


def step_logits(forward, model, kv_caches, token_ids, seq_lens, query_lens, tables):
    metadata = build_metadata(tables, seq_lens, query_lens, BLOCK_SIZE)
    with torch.inference_mode(), model_step(model, metadata, BLOCK_SIZE):
        hidden = forward(torch.tensor(token_ids), positions_for(seq_lens, query_lens),
                         kv_caches)
        return model.compute_logits(hidden)


def test_compiled_logits_match_eager_over_prefill_and_decode_steps(tmp_path) -> None:
    model_dir = build_tiny_llama_dir(tmp_path)
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    twin = load_model(model_dir, torch.float32, torch.device("cpu"))
    eager_runner = ModelRunner(model, 64, BLOCK_SIZE, torch.device("cpu"), torch.float32)
    compiled_runner = ModelRunner(twin, 64, BLOCK_SIZE, torch.device("cpu"), torch.float32,
                                  compiled=True)
    assert eager_runner.kernels.elementwise == "cpu" and compiled_runner.kernels.compiled
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    steps = [  # (token ids, seq lens, query lens): prefills, then a mixed step, then decodes
        ([5, 9, 11, 3, 7, 2, 8], [4, 3], [4, 3]),
        ([4, 6, 12, 13, 14, 15], [5, 4, 4], [1, 1, 4]),
        ([1, 2, 3], [6, 5, 5], [1, 1, 1]),
        ([9], [7], [1]),
    ]
    for token_ids, seq_lens, query_lens in steps:
        picked = tables[:len(seq_lens)]
        want = step_logits(model, model, eager_runner.kv_caches, token_ids, seq_lens,
                           query_lens, picked)
        got = step_logits(compiled_runner.forward, twin, compiled_runner.kv_caches, token_ids,
                          seq_lens, query_lens, picked)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_after_warm_up_no_token_count_recompiles(tmp_path) -> None:
    model = load_model(build_tiny_llama_dir(tmp_path), torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, 64, BLOCK_SIZE, torch.device("cpu"), torch.float32,
                         compiled=True)
    graphs_after_warm_up = counters["stats"]["unique_graphs"]
    assert graphs_after_warm_up >= 2, "warm-up compiles a one-token and a many-token graph"
    for num_tokens in (1, 3, HEAD_DIM, 64, 37):
        runner._placeholder_step(num_tokens)
    assert counters["stats"]["unique_graphs"] == graphs_after_warm_up


WARM_UP_AND_COUNT = """
import json, sys, torch
from torch._dynamo.utils import counters
from engine.weights.loader import load_model
from engine.executor.model_runner import ModelRunner
model = load_model(sys.argv[1], torch.float32, torch.device("cpu"), quantization="int4")
ModelRunner(model, 64, 4, torch.device("cpu"), torch.float32, compiled=True)
print(json.dumps(dict(counters["inductor"])))
"""


def test_a_restarted_engine_loads_its_graphs_from_the_compile_cache(tmp_path) -> None:
    """A warm start: the graph holds no frozen weights, so inductor's FX graph cache (under
    $LOOM_CACHE) stores it (int4: every linear is an opaque `loom::linear` call, any CPU)."""
    model_dir = build_tiny_llama_dir(tmp_path, num_hidden_layers=1)
    env = {name: value for name, value in os.environ.items()
           if name != "TORCHINDUCTOR_CACHE_DIR"}
    # Loom's own C++ kernels come built from the suite's cache (~40 s to build cold here):
    # only inductor's cache starts empty.
    env.setdefault("LOOM_KERNEL_CACHE", str(default_cache_dir() / "kernels"))
    env["LOOM_CACHE"] = str(tmp_path / "cache")

    def start() -> dict[str, int]:
        result = subprocess.run([sys.executable, "-c", WARM_UP_AND_COUNT, model_dir], env=env,
                                cwd=REPO_ROOT, capture_output=True, text=True, check=True)
        return json.loads(result.stdout.splitlines()[-1])

    cold = start()
    assert cold.get("fxgraph_cache_miss", 0) >= 2 and cold.get("fxgraph_cache_hit", 0) == 0
    assert any((tmp_path / "cache" / "inductor").iterdir())
    warm = start()
    assert warm.get("fxgraph_cache_hit", 0) >= 2 and warm.get("fxgraph_cache_miss", 0) == 0
