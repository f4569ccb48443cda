"""Decode steps replayed from kernel tapes answer to the eager forward, bit for bit; a forward
a tape cannot replay faithfully is refused and stays eager."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.core import EngineCore
from engine.executor import kernel_tape
from engine.executor.decode_tapes import MAX_TAPE_BATCH, StaticDecodeInputs, StepShape
from engine.executor.kernel_tape import RecordingRefused, record
from engine.kernels.elementwise import load_elementwise, run_add_rms_norm
from tests.engine_helpers import assert_no_leaks, greedy_request, make_core
from tests.model_fixtures import build_tiny_llama_dir
from tests.test_speculative_engine import spec_core

BLOCK_SIZE = 4  # the tiny runs cross many block boundaries


def staggered_requests(seed: int) -> list:
    """Five requests of different prompt and output lengths: the decode batch shrinks 5 -> 1
    as they finish, and the block tables grow mid-run."""
    generator = torch.Generator().manual_seed(seed)
    return [greedy_request(torch.randint(3, 250, (3 + 5 * i,), generator=generator).tolist(),
                           max_tokens=6 + 4 * i, request_id=f"r{i}", logprobs=2)
            for i in range(5)]


def outputs_with_logprobs(core: EngineCore, requests: list) -> dict[str, list]:
    for request in requests:
        core.add_request(request)
    outputs: dict[str, list] = {request.request_id: [] for request in requests}
    while core.has_work:
        for output in core.step().outputs:
            outputs[output.request_id].extend(zip(output.new_token_ids, output.logprobs,
                                                  strict=True))
    assert_no_leaks(core)
    return outputs


@pytest.mark.parametrize(("model_type", "dtype", "cache_dtype"), [
    ("llama", "float32", "auto"),
    ("llama", "bfloat16", "auto"),
    ("llama", "float32", "int8"),
    ("qwen3", "float32", "auto"),
    ("gemma3_text", "float32", "auto"),  # sliding layers: two KV cache groups
    ("qwen3_moe", "bfloat16", "auto"),
])
def test_taped_decodes_equal_eager_ones_token_and_logprob(tmp_path, model_type, dtype,
                                                          cache_dtype) -> None:
    model_dir = build_tiny_llama_dir(tmp_path, model_type)
    settings = {"dtype": dtype, "kv_cache_dtype": cache_dtype, "block_size": BLOCK_SIZE}
    eager = make_core(model_dir, enforce_eager=True, **settings)
    taped = make_core(model_dir, **settings)
    assert eager.runner.tapes is None and taped.runner.tapes is not None
    want = outputs_with_logprobs(eager, staggered_requests(0))
    got = outputs_with_logprobs(taped, staggered_requests(0))
    assert got == want
    tapes = taped.runner.tapes
    assert {(shape.rows, shape.requests) for shape in tapes.taped} | tapes.refused == {
        (n, n) for n in range(1, MAX_TAPE_BATCH + 1)}  # recorded at start
    if model_type == "llama":
        assert tapes.refused == set(), "the plain decoder must replay from tapes"


@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
def test_taped_speculative_steps_equal_eager_ones(tmp_path, cache_dtype) -> None:
    """Drafted decodes beside plain ones (rows > requests: each request's rows one run),
    drafts accepted and rejected at every position: tokens and logprobs bit for bit."""
    model_dir = build_tiny_llama_dir(tmp_path)
    settings = {"block_size": BLOCK_SIZE, "kv_cache_dtype": cache_dtype}
    want = outputs_with_logprobs(make_core(model_dir, enforce_eager=True, **settings),
                                 staggered_requests(2))
    continuations = {name: [token for token, _ in pairs] for name, pairs in want.items()}
    cores = [spec_core(model_dir, continuations, enforce_eager=eager, **settings)
             for eager in (True, False)]
    eager, taped = (outputs_with_logprobs(core, staggered_requests(2)) for core in cores)
    assert taped == eager
    assert [token for token, _ in taped["r4"]] == continuations["r4"]
    shapes = cores[1].runner.tapes.taped
    assert any(shape.requests < shape.rows for shape in shapes), shapes
    assert any(shape.requests > 1 and shape.requests < shape.rows for shape in shapes), shapes
    assert cores[1].speculator.totals.num_accepted_tokens > 0


def test_a_new_thread_count_records_its_own_tape(tmp_path) -> None:
    model_dir = build_tiny_llama_dir(tmp_path)
    eager = make_core(model_dir, enforce_eager=True, block_size=BLOCK_SIZE)
    taped = make_core(model_dir, block_size=BLOCK_SIZE)
    threads = torch.get_num_threads()
    prompt = list(range(5, 17))
    want = outputs_with_logprobs(eager, [greedy_request(prompt, 12, "a", logprobs=1)])
    got = outputs_with_logprobs(taped, [greedy_request(prompt, 6, "a", logprobs=1)])
    try:
        torch.set_num_threads(1)
        taped.step_threads = 1
        more = outputs_with_logprobs(taped, [greedy_request(prompt, 12, "b", logprobs=1)])
    finally:
        torch.set_num_threads(threads)
    assert got["a"] == want["a"][:6] and more["b"] == want["a"]
    assert set(taped.runner.tapes.taped) == {
        *(StepShape(n, n, threads) for n in range(1, MAX_TAPE_BATCH + 1)), StepShape(1, 1, 1)}


def test_a_forward_that_reads_a_value_stays_eager_and_correct(tmp_path, caplog) -> None:
    model_dir = build_tiny_llama_dir(tmp_path)
    eager = make_core(model_dir, enforce_eager=True, block_size=BLOCK_SIZE)
    taped = make_core(model_dir, block_size=BLOCK_SIZE)
    layer = taped.model.model.layers[0]
    forward = layer.forward

    def reads_a_value(x, *args):
        if float(x.abs().sum()) < 0:  # a value read into Python: a replay would skip it
            raise AssertionError("unreachable")
        return forward(x, *args)

    layer.forward = reads_a_value
    taped.runner.tapes.taped.clear()  # recorded at start, before the change: again
    with caplog.at_level(logging.WARNING):
        got = outputs_with_logprobs(taped, staggered_requests(1))
    assert got == outputs_with_logprobs(eager, staggered_requests(1))
    assert taped.runner.tapes.taped == {}
    assert taped.runner.tapes.refused == {(n, n) for n in range(1, 6)}
    assert "stay eager" in caplog.text and "reads a tensor's values" in caplog.text


def rms_norm_step(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
    """A kernel between torch ops: a functional op, a view, an in-place op."""
    doubled = x * 2
    out = torch.empty_like(doubled)
    run_add_rms_norm(load_elementwise(), doubled, residual, weight, 1e-6, out)
    return out.view(-1).add_(1.0)


def test_a_replay_recomputes_from_the_staged_inputs() -> None:
    x, residual, weight = torch.randn(3, 64), torch.randn(3, 64), torch.rand(64)
    staged = [x, residual, weight]
    tape, output = record(lambda: rms_norm_step(x, residual, weight), staged)
    assert len(tape.calls) == 3  # mul, the kernel, add_: the view and allocation are free
    for _ in range(2):
        x.copy_(torch.randn(3, 64))
        residual.copy_(torch.randn(3, 64))
        want = rms_norm_step(x.clone(), residual.clone(), weight)
        tape.replay()
        torch.testing.assert_close(output, want, rtol=0, atol=0)


def test_an_op_that_copies_only_sometimes_is_replayed_where_it_copied() -> None:
    """`contiguous` (and `reshape`) may return a view: recorded by what the call did."""
    wide = torch.randn(2, 96)

    def step():
        rows = wide[:, :64].contiguous()  # a copy: the rows are 96 apart
        return rms_norm_step(rows, torch.ones(2, 64), torch.ones(64))

    with torch.inference_mode():  # as the runner records: `contiguous` itself reaches the tape
        tape, output = record(step, [wide])
        assert tape.names[0] == "aten::contiguous"
        wide.copy_(torch.randn(2, 96))
        want = step()
        tape.replay()
    torch.testing.assert_close(output, want, rtol=0, atol=0)


def test_memory_the_tape_cannot_vouch_for_is_refused() -> None:
    x, residual, weight = torch.randn(3, 64), torch.randn(3, 64), torch.rand(64)
    elsewhere = torch.randn(3, 64)  # neither staged nor made while recording
    with pytest.raises(RecordingRefused, match="made outside the recording"):
        record(lambda: rms_norm_step(x, residual, weight) + elsewhere, [x, residual, weight])

    def kernel_on_outside_memory():
        out = torch.empty_like(x)
        run_add_rms_norm(load_elementwise(), elsewhere, None, weight, 1e-6, out)
        return out

    with pytest.raises(RecordingRefused, match="points outside memory"):
        record(kernel_on_outside_memory, [x, weight])


def test_a_tensor_made_from_python_values_is_refused() -> None:
    x = torch.randn(4)
    with pytest.raises(RecordingRefused, match="reads a tensor's values"):
        record(lambda: x + torch.tensor([1.0, 2.0, 3.0, 4.0]), [x])


def test_recording_puts_the_kernels_back() -> None:
    library = load_elementwise()
    before = library.loom_add_rms_norm
    with pytest.raises(RecordingRefused):
        record(lambda: torch.randn(2).sum().item(), [])
    assert library.loom_add_rms_norm is before
    assert not isinstance(library.loom_add_rms_norm, kernel_tape.RecordingKernel)


def test_staged_write_rows_are_each_token_and_heads_cache_row() -> None:
    inputs = StaticDecodeInputs.allocate(StepShape(2, 2, 1), width=4, block_size=4,
                                         num_kv_heads=3, num_groups=1)
    inputs.stage([7, 8], [5, 2], [1, 1], [[9 * 4 + 1, 2 * 4 + 2]], [[[3, 9], [2]]])
    # slot 37 = block 9 offset 1; slot 10 = block 2 offset 2; row = (block * H + h) * bs + off
    assert inputs.write_rows[0].tolist() == [(9 * 3 + h) * 4 + 1 for h in range(3)] + \
        [(2 * 3 + h) * 4 + 2 for h in range(3)]
    assert inputs.block_tables[0][:, :2].tolist() == [[3, 9], [2, 0]]
    assert inputs.lens.tolist() == [6, 3] and inputs.positions.tolist() == [5, 2]
    assert inputs.runs is None


def test_staged_drafted_rows_are_each_a_decode_over_its_causal_prefix() -> None:
    """Request 0: one decode at position 5; request 1: its last token at 2 and two drafts."""
    inputs = StaticDecodeInputs.allocate(StepShape(4, 2, 1), width=2, block_size=4,
                                         num_kv_heads=1, num_groups=1)
    inputs.stage([7, 8, 9, 10], [5, 2, 3, 4], [1, 3], [[37, 10, 11, 12]], [[[3, 9], [2, 6]]])
    assert inputs.lens.tolist() == [6, 3, 4, 5]
    assert inputs.block_tables[0].tolist() == [[3, 9], [2, 6], [2, 6], [2, 6]]
    assert inputs.runs is not None and inputs.runs.tolist() == [0, 1, 4]
    assert inputs.num_requests == 2
