"""bench.gpu_step_profile on the CPU (its dry run): the engine it builds is decoding every
request by the time it is timed, and the profile table names the ops the steps ran."""

from __future__ import annotations

from bench.gpu_step_profile import decoding_core, kernel_table, median_step_ms
from tests.model_fixtures import build_tiny_llama_dir


def test_profiled_steps_are_decodes_of_every_request(tmp_path) -> None:
    core = decoding_core(build_tiny_llama_dir(tmp_path), "cpu", eager=True, batch=3,
                         context=40)
    assert not core.scheduler.waiting and len(core.scheduler.running) == 3
    decoded = [request.num_output_tokens for request in core.scheduler.running]
    assert min(decoded) > 1  # past the prefill, every row a decode
    assert median_step_ms(core, "cpu", 4) > 0
    assert [request.num_output_tokens - before for request, before in
            zip(core.scheduler.running, decoded, strict=True)] == [4, 4, 4]
    table = kernel_table(core, "cpu", 2)
    assert "aten::" in table and "Self CPU" in table
