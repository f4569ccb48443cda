"""Batch-invariant mode: a row's logits are the same bits alone, beside other requests, on a
prefix-cache hit, chunked and after preemption, in fp32, bf16 and every quantization method
(engine tier, a small random model; every sampled row's logits compared with torch.equal)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch

from common.config import EngineConfig, batch_invariant_from_env
from common.protocol import AddRequest
from common.sampling import SamplingParams
from engine.attention.forward_context import forward_context
from engine.core import EngineCore
from engine.layers.batch_invariant import min_rows, use_dense_copies, with_padded_rows
from engine.quantization.registry import METHODS, attach_dense_copies
from engine.quantization.unquantized import PackedLinear, packing_applies
from tests.engine_helpers import make_core, run_to_completion
from tests.model_fixtures import build_tiny_llama_dir

# Wide enough for the GEMM libraries to switch kernels with the row count (they do not on
# the 64-wide tiny model), head_dim 64 for the kernel's vector path, a tied output head.
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True}
CONFIGS = [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8"),
           ("bfloat16", "int4"), ("bfloat16", "w8a8"), ("float32", "w8a8"), ("float32", "int4"),
           ("float32", "w4a8")]
PROMPT = [5 + (7 * i) % 300 for i in range(45)]  # 45 tokens: two full blocks and a part
OUTPUT_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_llama_dir(tmp_path_factory.mktemp("invariant"), **SHAPE)


def target(request_id: str = "target") -> AddRequest:
    """The request every scenario follows: seeded sampling at temperature 1 through the
    sampler's filters and penalties (they work on each row alone)."""
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=1.0, top_p=0.95, top_k=200,
                            repetition_penalty=1.1, presence_penalty=0.2, seed=7,
                            ignore_eos=True)
    return AddRequest(request_id, PROMPT, params, 0.0)


def others(count: int, seed: int = 0) -> list[AddRequest]:
    generator = torch.Generator().manual_seed(seed)
    requests = []
    for i in range(count):
        length = int(torch.randint(3, 70, (1,), generator=generator))
        prompt = torch.randint(3, 500, (length,), generator=generator).tolist()
        params = SamplingParams(max_tokens=int(torch.randint(4, 20, (1,), generator=generator)),
                                temperature=0.8, seed=100 + i, ignore_eos=True)
        requests.append(AddRequest(f"other-{i}", prompt, params, 0.0))
    return requests


def capture_logits(core: EngineCore) -> dict[str, list[torch.Tensor]]:
    """Every sampled row's logits, by request id, as the sampler gets them."""
    captured: dict[str, list[torch.Tensor]] = defaultdict(list)
    execute = core._execute

    def recording(chunks, give_way=None):
        sampling, logits, pooled = execute(chunks, give_way)
        for chunk, row in zip(sampling, logits, strict=True):
            captured[chunk.request.request_id].append(row.clone())
        return sampling, logits, pooled

    core._execute = recording
    return captured


def run(model_dir: str, dtype: str, quantization: str, requests: list[AddRequest],
        **overrides) -> tuple[EngineCore, dict[str, list[torch.Tensor]], dict[str, list[int]]]:
    core = make_core(model_dir, dtype=dtype, quantization=quantization, batch_invariant=True,
                     **overrides)
    logits = capture_logits(core)
    return core, logits, run_to_completion(core, requests)


@pytest.mark.parametrize(("dtype", "quantization"), CONFIGS,
                         ids=[f"{d}-{q}" for d, q in CONFIGS])
def test_a_rows_logits_do_not_depend_on_its_step(model_dir: str, dtype: str,
                                                  quantization: str) -> None:
    assert_invariant(model_dir, dtype, quantization)


def test_on_code_kernels_alone_the_mode_pads_nothing(model_dir: str) -> None:
    """fp32 with every linear int4 (groups of 32): our kernel sums each output in one order,
    so the mode runs it at every step size and pads no step (test above: fp32-int4)."""
    coded = make_core(model_dir, dtype="float32", quantization="int4", batch_invariant=True)
    assert coded.runner.kernels.code_kernels and not coded.runner.kernels.padded_steps
    assert "every product on the codes" in coded.runner.kernels.describe()
    dense = make_core(model_dir, dtype="float32", quantization="none", batch_invariant=True)
    assert not dense.runner.kernels.code_kernels and dense.runner.kernels.padded_steps


@pytest.mark.parametrize(("dtype", "quantization"), [("float32", "none"), ("bfloat16", "int4")],
                         ids=["fp32", "bf16-int4"])
def test_a_mixture_of_experts_rows_logits_do_not_depend_on_its_step(
    tmp_path: Path, dtype: str, quantization: str,
) -> None:
    """Experts see as many rows as route to them: their products and the router's are
    padded too."""
    model_dir = build_tiny_llama_dir(tmp_path, "qwen3_moe", **SHAPE, head_dim=64, num_experts=4,
                                     num_experts_per_tok=2, moe_intermediate_size=256,
                                     norm_topk_prob=True)
    assert_invariant(model_dir, dtype, quantization)


def assert_invariant(model_dir: str, dtype: str, quantization: str) -> None:
    """The target's sampled rows alone, then on a prefix hit, beside 12 others, chunked by 16
    and preempted and recomputed: the same tokens and the same bits."""
    core, alone, tokens = run(model_dir, dtype, quantization, [target()])
    want, want_tokens = alone["target"], tokens["target"]
    assert len(want) == OUTPUT_TOKENS

    # The same prompt again on the same engine: a prefix-cache hit on its two full blocks.
    hit = capture_logits(core)
    again = run_to_completion(core, [target("again")])
    assert core.block_manager.stats.hits > 0
    scenarios = {"prefix hit": (hit["again"], again["again"])}

    _, beside, tokens = run(model_dir, dtype, quantization, [*others(12), target()])
    scenarios["beside 12 others"] = beside["target"], tokens["target"]

    _, chunked, tokens = run(model_dir, dtype, quantization, [target(), *others(3, seed=1)],
                             max_num_batched_tokens=16)
    scenarios["chunked by 16"] = chunked["target"], tokens["target"]

    core, preempted, tokens = run(model_dir, dtype, quantization,
                                  [*others(4, seed=2), target()], num_kv_blocks=9)
    assert "target" in {rid for trace in core.traces for rid in trace.preempted}
    scenarios["preempted and recomputed"] = preempted["target"], tokens["target"]

    for name, (got, got_tokens) in scenarios.items():
        # Up to the first changed token (after it the logits differ as a consequence)
        for position, (row, wanted) in enumerate(zip(got, want, strict=False)):
            assert torch.equal(row, wanted), f"{name}: logits of output {position} differ"
        assert got_tokens == want_tokens, name
        assert len(got) == len(want), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", ["none", *METHODS])
def test_every_linear_gives_a_row_the_same_bits_at_every_row_count(
    method: str, dtype: torch.dtype,
) -> None:
    """The mode's products, by method: a row's output alone equals it inside 1-200 rows."""
    weight = torch.randn(1536, 576) * 0.05
    if method == "none" and packing_applies(torch.device("cpu"), dtype):
        layer = PackedLinear(weight.to(dtype), None)  # as prepack_linears leaves a bf16 model
    elif method == "none":
        layer = torch.nn.Linear(576, 1536, bias=False, dtype=dtype)
        layer.weight.data = weight.to(dtype)
    else:
        layer = METHODS[method](weight.to(dtype), None, 32)
        attach_dense_copies([layer])
        holder = torch.nn.Sequential(layer)
        assert use_dense_copies(holder) == (layer.dense is not None)
    x = torch.randn(200, 576).to(dtype)
    with forward_context([], None, pad_products=True):  # type: ignore[arg-type]
        alone = with_padded_rows(layer.forward, x[:1])
        least = min_rows(dtype)
        for rows in (2, 3, 5, 16, 17, 33, least - 1, least, 130, 200):
            got = with_padded_rows(layer.forward, x[:rows])
            assert got.shape[0] == rows
            assert torch.equal(got[:1], alone), f"{rows} rows"


def test_vllms_environment_switch_turns_the_mode_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert batch_invariant_from_env()
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert not batch_invariant_from_env()


def test_the_mode_is_refused_where_it_cannot_hold(model_dir: str) -> None:
    with pytest.raises(ValueError, match="--compile"):
        EngineConfig(model=model_dir, batch_invariant=True, compile=True)
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(model=model_dir, batch_invariant=True, tensor_parallel_size=2)


def test_the_mode_needs_the_cpp_attention_kernel(model_dir: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOM_CPP_DECODE", "0")  # as a CPU where the kernel does not build
    with pytest.raises(ValueError, match="C\\+\\+ attention kernel"):
        make_core(model_dir, batch_invariant=True)


def test_the_mode_logs_what_it_runs(model_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO"):
        core = make_core(model_dir, batch_invariant=True)
    assert core.runner.attention.rows_only
    assert any("batch-invariant" in record.getMessage() for record in caplog.records)


def test_by_default_only_steps_with_prompt_rows_are_padded(
    model_dir: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Eager: each step's forward is seen here (a taped decode replays its own exact size,
    # tests/test_decode_tapes.py).
    core = make_core(model_dir, dtype="bfloat16", enforce_eager=True)
    assert core.runner.kernels.padded_steps and not core.runner.attention.rows_only
    rows: list[int] = []
    forward = core.runner.forward
    monkeypatch.setattr(core.runner, "forward",
                        lambda ids, *args: rows.append(ids.shape[0]) or forward(ids, *args))
    run_to_completion(core, [target()])
    # the 45-token prompt, then decodes
    assert rows == [min_rows(torch.bfloat16)] + [1] * (OUTPUT_TOKENS - 1)


@pytest.mark.parametrize(("dtype", "quantization"), CONFIGS,
                         ids=[f"{d}-{q}" for d, q in CONFIGS])
def test_by_default_a_prefix_hit_does_not_change_a_prompts_logits(model_dir: str, dtype: str,
                                                                  quantization: str) -> None:
    """The default configuration: the same seeded request cold, then on the cache its first
    run filled (two of its three blocks, the rest recomputed as a short chunk)."""
    core = make_core(model_dir, dtype=dtype, quantization=quantization)
    logits = capture_logits(core)
    cold = run_to_completion(core, [target("cold")])
    cached = run_to_completion(core, [target("cached")])
    assert core.block_manager.stats.hits > 0
    assert cached["cached"] == cold["cold"]
    for position, (row, wanted) in enumerate(zip(logits["cached"], logits["cold"],
                                                  strict=True)):
        assert torch.equal(row, wanted), f"logits of output {position} differ"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_by_default_a_long_prompts_prefix_hit_does_not_change_its_logits(
        tmp_path: Path, dtype: str) -> None:
    """A prompt longer than 512 tokens: cold in one chunk, then on the cache with a short
    chunk left. Both chunks run through one kernel (the AMX prefill kernel, or rows of the
    decode kernel: SDPA took long chunks once, and the hit changed the logits)."""
    model_dir = build_tiny_llama_dir(tmp_path, **SHAPE, max_position_embeddings=1024)
    core = make_core(model_dir, dtype=dtype, max_num_batched_tokens=1024)
    logits = capture_logits(core)
    prompt = [5 + (7 * i) % 300 for i in range(600)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    cold = run_to_completion(core, [AddRequest("cold", prompt, params, 0.0)])
    cached = run_to_completion(core, [AddRequest("cached", prompt, params, 0.0)])
    assert core.block_manager.stats.hits > 0
    assert cached["cached"] == cold["cold"]
    for position, (row, wanted) in enumerate(zip(logits["cached"], logits["cold"],
                                                  strict=True)):
        assert torch.equal(row, wanted), f"logits of output {position} differ"


def capture_verified_logits(core: EngineCore) -> list[tuple[str, int, list[int], torch.Tensor]]:
    """Per sampled chunk: (request id, its output count before the step, its drafts, the
    logits of its 1 + drafts rows). Row j predicts output position `count + j` given the
    first j drafts."""
    records: list[tuple[str, int, list[int], torch.Tensor]] = []
    execute = core._execute

    def recording(chunks, give_way=None):
        sampling, logits, pooled = execute(chunks, give_way)
        offset = 0
        for chunk in sampling:
            rows = 1 + len(chunk.draft_token_ids)
            records.append((chunk.request.request_id, chunk.request.num_output_tokens,
                            list(chunk.draft_token_ids), logits[offset:offset + rows].clone()))
            offset += rows
        assert offset == logits.shape[0]
        return sampling, logits, pooled

    core._execute = recording
    return records


@pytest.mark.parametrize(("dtype", "quantization"),
                         [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int4")],
                         ids=["fp32", "bf16", "bf16-int4"])
def test_speculative_drafts_keep_a_rows_bits(model_dir: str, dtype: str,
                                             quantization: str) -> None:
    """In the mode, a row verified as a draft (accepted or the one after a rejection) has
    the bits of the same position decoded one token a step alone, and seeded sampling gives
    the same tokens: drafts from the known continuation, spoiled every third call."""
    from tests.test_speculative_engine import NGRAM, FixedCost, OracleDrafts

    _, alone, tokens = run(model_dir, dtype, quantization, [target()])
    want, want_tokens = alone["target"], tokens["target"]
    core = make_core(model_dir, dtype=dtype, quantization=quantization, batch_invariant=True,
                     speculative_config=NGRAM)
    core.speculator.source = OracleDrafts({"target": want_tokens})
    core.speculator.cost = FixedCost()
    records = capture_verified_logits(core)
    got_tokens = run_to_completion(core, [*others(6), target()])["target"]
    assert core.speculator.totals.num_accepted_tokens > 0
    assert core.speculator.totals.num_accepted_tokens < core.speculator.totals.num_draft_tokens
    assert got_tokens == want_tokens
    checked = set()
    for request_id, first, drafts, rows in records:
        if request_id != "target":
            continue
        for j in range(rows.shape[0]):
            if drafts[:j] != got_tokens[first:first + j]:
                break  # rows after a rejected draft predict from a wrong prefix
            assert torch.equal(rows[j], want[first + j]), f"output {first + j}, row {j}"
            checked.add(first + j)
    assert checked == set(range(OUTPUT_TOKENS))


@pytest.mark.parametrize(("dtype", "quantization"), [("float32", "none"), ("bfloat16", "int4")],
                         ids=["fp32", "bf16-int4"])
def test_two_data_parallel_replicas_give_a_row_the_same_bits(
    model_dir: str, dtype: str, quantization: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two engines of one configuration as `launch.py --data-parallel-size 2` starts them
    on two cores (one thread each): the target alone on one, beside 12 others on the other."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the engine keeps the thread count it is given
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, first, first_tokens = run(model_dir, dtype, quantization, [target()])
        _, second, second_tokens = run(model_dir, dtype, quantization,
                                       [*others(12, seed=3), target()])
    finally:
        torch.set_num_threads(threads)
    assert second_tokens["target"] == first_tokens["target"]
    for position, (row, wanted) in enumerate(zip(second["target"], first["target"],
                                                  strict=True)):
        assert torch.equal(row, wanted), f"logits of output {position} differ"
