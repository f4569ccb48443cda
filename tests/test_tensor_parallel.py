"""Tensor parallelism (engine.distributed.tensor_parallel): TP=2 on the CPU over gloo, two processes
(this one as rank 0, engine.distributed.tp_worker as rank 1).

- every step's logits of a mixed, chunked batch equal TP=1's within 1e-4 (fp32), on the
  tiny model (also with an uneven split: 3 KV heads over 2 ranks, a vocabulary of odd size)
  and on SmolLM2 (9 heads, 3 KV heads);
- through launch.py, the same greedy text as TP=1 on SmolLM2;
- a dead rank fails the server cleanly: the open stream ends with an error event and launch
  exits non-zero, instead of hanging.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import torch

from bench.launched import child_pids, command_line
from bench.soak import StreamOutcome, stream_one
from common.default_model import resolve_model
from common.sockets import free_port
from engine.distributed.tensor_parallel import TPShard
from engine.executor.model_runner import StepInputs
from tests.engine_helpers import greedy_request, make_core, run_to_completion
from tests.launched_server import LaunchedServer
from tests.model_fixtures import build_tiny_llama_dir
from tests.tiny_server import TINY_MODEL_NAME, shared_tiny_model, tiny_server

LOGIT_TOLERANCE = 1e-4
REPO = Path(__file__).resolve().parent.parent


def test_spans_cover_everything_once() -> None:
    for total in (1, 2, 3, 9, 255, 49152):
        for size in (1, 2, 3, 4):
            spans = [TPShard(rank, size).span(total) for rank in range(size)]
            assert spans[0][0] == 0 and spans[-1][1] == total
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
            assert max(e - s for s, e in spans) - min(e - s for s, e in spans) <= 1
            vocab = [TPShard(rank, size).vocab_span(total) for rank in range(size)]
            assert vocab[0][0] == 0 and vocab[-1][1] == total
    assert [TPShard(rank, 2).span(3) for rank in range(2)] == [(0, 2), (2, 3)]


def test_step_inputs_travel_as_one_tensor() -> None:
    inputs = StepInputs([5, 6, 7, 8], [3, 0, 1, 2], [[35, 16, 17, 18], [51, 96, 97, 98]],
                        [1, 3], [4, 3], [[[2], [1, 4]], [[3], [5, 6]]], [0, 3])
    back = StepInputs.unpack(inputs.pack())
    assert (back.token_ids, back.positions, back.slot_mappings, back.query_lens,
            back.seq_lens, back.sample_rows) == ([5, 6, 7, 8], [3, 0, 1, 2],
                                                 [[35, 16, 17, 18], [51, 96, 97, 98]],
                                                 [1, 3], [4, 3], [0, 3])
    # Per KV cache group, padded: never read past the length
    assert back.block_tables == [[[2, 0], [1, 4]], [[3, 0], [5, 6]]]


def step_logits(model_dir: str, tensor_parallel_size: int, prompts: list[list[int]],
                **settings) -> tuple[dict[str, list[int]], list[torch.Tensor]]:
    """Greedy outputs and every step's logits of a mixed batch (chunked prefill: 32 tokens a
    step) on an engine of `tensor_parallel_size` ranks."""
    core = make_core(model_dir, tensor_parallel_size=tensor_parallel_size,
                     max_num_batched_tokens=32, **settings)
    seen: list[torch.Tensor] = []
    sample = core.sampler.sample

    def recording(logits: torch.Tensor, *args) -> object:
        seen.append(logits.clone())
        return sample(logits, *args)

    core.sampler.sample = recording  # type: ignore[method-assign]
    try:
        batch = [greedy_request(prompt, 8, request_id=str(i)) for i, prompt in enumerate(prompts)]
        return run_to_completion(core, batch), seen
    finally:
        core.shutdown()


def assert_tp2_equals_tp1(model_dir: str, prompts: list[list[int]], **settings) -> None:
    single, single_logits = step_logits(model_dir, 1, prompts, **settings)
    split, split_logits = step_logits(model_dir, 2, prompts, **settings)
    assert len(split_logits) == len(single_logits) > 0
    for ours, reference in zip(split_logits, single_logits, strict=True):
        assert ours.shape == reference.shape
        assert (ours - reference).abs().max().item() < LOGIT_TOLERANCE
    assert split == single


@pytest.mark.parametrize(("model_type", "shape"), [
    ("llama", {}),  # 4 heads over 2 KV heads: one KV head each
    ("llama", {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96,
               "vocab_size": 255}),  # KV heads 2 + 1, vocabulary slices 128 + 127
    ("qwen3", {"head_dim": 16}),  # q/k norms over each rank's heads
    ("qwen3_moe", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "norm_topk_prob": True}),  # experts split
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                 "sliding_window": 16}),  # experts split, windows over each rank's heads
    ("gemma2", {"head_dim": 16, "sliding_window": 16, "query_pre_attn_scalar": 16,
                "attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0,
                "tie_word_embeddings": True}),  # caps, a tied head split by vocabulary
    ("phi3", {}),  # the checkpoint's fused qkv and gate_up split by parts
], ids=["even", "uneven", "qwen3", "qwen3_moe", "mixtral", "gemma2", "phi3"])
def test_tp2_logits_equal_tp1_on_the_tiny_model(model_type: str, shape: dict,
                                                tmp_path: Path) -> None:
    model_dir = build_tiny_llama_dir(tmp_path, model_type, **shape)
    prompts = [[(11 * i + 5 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([5, 40, 17])]
    assert_tp2_equals_tp1(model_dir, prompts)


def test_tp2_with_an_int8_kv_cache_equals_tp1(tmp_path: Path) -> None:
    """Each rank quantizes its own KV heads' rows (2 + 1 here) as one rank does them all."""
    model_dir = build_tiny_llama_dir(tmp_path, "llama", num_attention_heads=6,
                                     num_key_value_heads=3, hidden_size=96)
    prompts = [[(11 * i + 5 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([5, 40, 17])]
    assert_tp2_equals_tp1(model_dir, prompts, kv_cache_dtype="int8")


def test_tp2_logits_equal_tp1_on_smollm2() -> None:
    prompts = [[(13 * i + 7 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate([9, 45])]
    assert_tp2_equals_tp1(resolve_model(None), prompts)


def tp_worker_pid(server: LaunchedServer) -> int:
    for engine in child_pids(server.process.pid):
        for pid in child_pids(engine):
            if "engine.distributed.tp_worker" in command_line(pid):
                return pid
    raise LookupError("no tensor-parallel worker")


@pytest.mark.e2e
async def test_launch_with_tp2_says_what_tp1_says(
        tmp_path_factory: pytest.TempPathFactory, float32_default_server: LaunchedServer) -> None:
    body = {"messages": [{"role": "user", "content": "Name three primary colors."}],
            "max_tokens": 24, "temperature": 0}

    async def answer(server: LaunchedServer) -> str:
        async with aiohttp.ClientSession() as http, http.post(
                server.base_url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
            return (await response.json())["choices"][0]["message"]["content"]

    one_rank = await answer(float32_default_server)  # the same flags, one rank
    server = LaunchedServer(["--dtype", "float32", "--tensor-parallel-size", "2"])
    with server.start(tmp_path_factory.mktemp("logs")):
        tp_worker_pid(server)  # rank 1 runs
        assert await answer(server) == one_rank and one_rank


@pytest.mark.e2e
async def test_a_dead_rank_fails_the_server_cleanly(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    model = shared_tiny_model(tmp_path_factory)
    server = tiny_server(model, "--tensor-parallel-size", "2", "--num-kv-blocks", "512")
    server.start(tmp_path_factory.mktemp("logs"))
    try:
        body = {"model": TINY_MODEL_NAME, "prompt": "Tell me everything", "max_tokens": 1500,
                "ignore_eos": True, "stream": True}
        outcome = StreamOutcome()
        async with aiohttp.ClientSession() as http:
            streaming = asyncio.ensure_future(stream_one(
                http, server.base_url + "/v1/completions", body, outcome=outcome))
            async with asyncio.timeout(60):  # tokens are flowing before the kill
                while not outcome.chunks:
                    await asyncio.sleep(0.01)
            os.kill(tp_worker_pid(server), signal.SIGKILL)
            await asyncio.wait_for(streaming, 30)
        assert outcome.status == 200 and outcome.error and outcome.finish_reason is None
        assert "engine" in outcome.error.lower()
        assert await asyncio.to_thread(server.process.wait, 30) != 0
        assert "tensor-parallel rank 1 exited" in server.log
    finally:
        server.stop()
    assert not child_pids(server.process.pid)


@pytest.mark.e2e
async def test_ranks_on_two_nodes_join_through_the_rendezvous(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Node 1 (`launch.py --headless --node-rank 1`) runs rank 1; node 0 runs the engine and
    rank 0; both on this host, joined through --master-addr/--master-port."""
    model = shared_tiny_model(tmp_path_factory)
    logs = tmp_path_factory.mktemp("logs")
    port = str(free_port())
    tp = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
          "--master-port", port, "--num-kv-blocks", "256"]
    body = {"model": TINY_MODEL_NAME, "prompt": "One, two, three", "max_tokens": 8,
            "temperature": 0}
    answers = []
    with open(logs / "node1.log", "wb") as node1_log:
        node1 = subprocess.Popen(
            [sys.executable, "launch.py", "--model", model, "--dtype", "float32", "--headless",
             "--node-rank", "1", *tp], cwd=REPO, stdout=node1_log, stderr=subprocess.STDOUT)
        try:
            for server in (tiny_server(model, *tp, "--node-rank", "0"), tiny_server(model)):
                with server.start(logs):
                    async with aiohttp.ClientSession() as http, http.post(
                            server.base_url + "/v1/completions", json=body) as response:
                        assert response.status == 200
                        answers.append((await response.json())["choices"][0]["text"])
                if len(answers) == 1:  # node 0 stopped: node 1's rank is told to stop too
                    assert await asyncio.to_thread(node1.wait, 30) == 0
        finally:
            if node1.poll() is None:
                node1.kill()
                node1.wait()
    assert "ranks 1..1 joining 127.0.0.1" in (logs / "node1.log").read_text()
    assert answers[0] == answers[1] and answers[0]
