"""GET /metrics: Prometheus text with the `loom:` names, fed by engine stats and requests."""

from __future__ import annotations

import asyncio

import pytest

from bench.metrics import parse_prometheus
from common.protocol import StepStats
from frontend.metrics import LoomMetrics
from frontend.request_metrics import RequestTimer
from tests.fake_engine import FrontendHarness

EXPECTED_NAMES = [
    "loom:num_requests_running", "loom:num_requests_waiting", "loom:kv_cache_usage_perc",
    "loom:num_preemptions_total", "loom:prompt_tokens_total", "loom:generation_tokens_total",
    "loom:prefix_cache_queries_total", "loom:prefix_cache_hits_total",
    "loom:kv_integrity_violations_total", "loom:engine_bad_frames_total",
    "loom:frontend_bad_frames_total", "loom:time_to_first_token_seconds_count",
    "loom:inter_token_latency_seconds_count", "loom:e2e_request_latency_seconds_count",
    "loom:request_queue_time_seconds_count", "loom:step_time_seconds_count",
    "loom:request_decode_time_seconds_count", "loom:request_prompt_tokens_count",
    "loom:request_generation_tokens_count",
]


def samples(metrics: LoomMetrics) -> dict[str, float]:
    return parse_prometheus(metrics.render().decode()).samples


def test_every_metric_is_exported_with_its_type() -> None:
    metrics = LoomMetrics()
    snapshot = parse_prometheus(metrics.render().decode())
    for name in EXPECTED_NAMES:
        assert name in snapshot.samples, name
    assert snapshot.types["loom:num_requests_running"] == "gauge"
    assert snapshot.types["loom:num_preemptions_total"] == "counter"
    assert snapshot.types["loom:step_time_seconds"] == "histogram"


def test_engine_totals_never_go_backwards() -> None:
    metrics = LoomMetrics()
    seen = []
    for total in [5, 3, 7, 7, float("nan"), 8]:
        metrics.observe_step(StepStats(num_preemptions_total=total, step_time_s=0.01))
        seen.append(samples(metrics)["loom:num_preemptions_total"])
    assert seen == sorted(seen)
    assert seen[-1] == 5 + (7 - 3) + (8 - 7)  # after a lower total, counting resumes from it


def test_step_stats_feed_gauges_counters_and_step_times() -> None:
    metrics = LoomMetrics()
    metrics.observe_step(StepStats(num_running=3, num_waiting=2, kv_cache_usage=0.25,
                                   num_prompt_tokens=100, num_generation_tokens=3,
                                   step_time_s=0.02, prefix_cache_queries_total=64,
                                   prefix_cache_hits_total=32, bad_frames_total=1))
    metrics.observe_step(StepStats(num_running=3, num_generation_tokens=3, step_time_s=0.01,
                                   prefix_cache_queries_total=64, prefix_cache_hits_total=32,
                                   bad_frames_total=1))
    metrics.observe_step(StepStats(kv_integrity_violations_total=0))  # going idle: no step
    values = samples(metrics)
    assert values["loom:num_requests_running"] == 0
    assert values["loom:kv_cache_usage_perc"] == 0
    assert values["loom:prompt_tokens_total"] == 100
    assert values["loom:generation_tokens_total"] == 6
    assert values["loom:prefix_cache_queries_total"] == 64
    assert values["loom:prefix_cache_hits_total"] == 32
    assert values["loom:engine_bad_frames_total"] == 1
    assert values["loom:step_time_seconds_count"] == 2
    assert values["loom:step_time_seconds_sum"] == pytest.approx(0.03)


def test_an_engine_is_at_rest_from_its_going_idle_report_until_its_next_step() -> None:
    metrics = LoomMetrics()
    at_rest = 'loom:engine_at_rest{engine="1"}'
    metrics.observe_step(StepStats(num_running=1, step_time_s=0.01), 1)
    assert samples(metrics)[at_rest] == 0
    metrics.observe_step(StepStats(at_rest=True), 1)
    assert samples(metrics)[at_rest] == 1
    metrics.observe_step(StepStats(num_running=1, step_time_s=0.01), 1)
    assert samples(metrics)[at_rest] == 0
    metrics.engine_gone(1)  # a dead engine sends no report: nothing to wait for
    assert at_rest not in samples(metrics)
    metrics.engine_gone(1)


def test_tokens_arriving_with_the_first_one_count_as_inter_token_gaps() -> None:
    metrics = LoomMetrics()
    timer = RequestTimer(metrics, num_prompt_tokens=5)
    timer.tokens(3, queue_time_s=None)  # a spec-decoded or coalesced first frame
    timer.tokens(2, queue_time_s=None)
    values = samples(metrics)
    assert values["loom:time_to_first_token_seconds_count"] == 1
    assert values["loom:inter_token_latency_seconds_count"] == 4


async def scrape(harness: FrontendHarness) -> dict[str, float]:
    response = await harness.client.get("/metrics")
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    return parse_prometheus(await response.text()).samples


async def test_requests_are_timed_and_counted_per_choice(harness: FrontendHarness) -> None:
    script = harness.reply_with("Hello world!")  # then EOS
    body = {"prompt": "Hi", "n": 2}
    assert (await harness.client.post("/v1/completions", json=body)).status == 200
    response = await harness.client.post("/v1/completions", json=body | {"stream": True})
    await response.read()
    values = await scrape(harness)
    choices = 4
    assert values['loom:request_success_total{finished_reason="stop"}'] == choices
    assert values["loom:time_to_first_token_seconds_count"] == choices
    assert values["loom:request_queue_time_seconds_count"] == choices
    # The engine's own figure, once per choice.
    assert values["loom:request_queue_time_seconds_sum"] == pytest.approx(
        choices * harness.engine.queue_time_s)
    assert values["loom:e2e_request_latency_seconds_count"] == choices
    # Every token after each choice's first one is an inter-token gap.
    assert values["loom:inter_token_latency_seconds_count"] == choices * (len(script) - 1)
    assert values["loom:generation_tokens_total"] == choices * len(script)
    assert values["loom:request_generation_tokens_sum"] == choices * len(script)
    prompt_tokens = [len(add.prompt_token_ids) for add in harness.engine.adds]
    assert len(prompt_tokens) == choices
    assert values["loom:request_prompt_tokens_count"] == choices
    assert values["loom:request_prompt_tokens_sum"] == sum(prompt_tokens)
    assert values["loom:request_decode_time_seconds_count"] == choices
    decode_s, e2e_s = (values[f"loom:{name}_seconds_sum"]
                       for name in ("request_decode_time", "e2e_request_latency"))
    assert 0 < decode_s < e2e_s
    assert values["loom:step_time_seconds_count"] == 0  # the fake engine times no steps


async def test_a_client_that_leaves_counts_as_abort(harness: FrontendHarness) -> None:
    harness.reply_with("Hello world!", eos=False)
    harness.engine.step_interval_s = 0.01
    response = await harness.client.post(
        "/v1/completions", json={"prompt": "Hi", "max_tokens": 200, "stream": True})
    await response.content.readuntil(b"\n\n")
    response.close()
    await harness.engine.wait_for(lambda: bool(harness.engine.aborted))
    abort_count = 'loom:request_success_total{finished_reason="abort"}'
    async with asyncio.timeout(5):  # the handler counts it as it unwinds
        while (values := await scrape(harness)).get(abort_count, 0) == 0:
            pass
    assert values[abort_count] == 1


async def test_bad_frames_from_the_engine_are_counted(harness: FrontendHarness) -> None:
    await harness.engine.send_raw(b"\xc1 not msgpack")
    harness.reply_with("Hi")
    assert (await harness.client.post("/v1/completions", json={"prompt": "Hi"})).status == 200
    assert (await scrape(harness))["loom:frontend_bad_frames_total"] == 1


def test_speculative_counters_follow_each_engines_totals_by_position() -> None:
    metrics = LoomMetrics()
    for engine, accepted in ((0, [4, 2]), (1, [1, 0]), (0, [6, 3])):
        metrics.observe_step(StepStats(
            spec_decode_num_drafts_total=sum(accepted), spec_decode_num_draft_tokens_total=10,
            spec_decode_num_accepted_tokens_total=sum(accepted),
            spec_decode_accepted_by_position_total=accepted, step_time_s=0.01), engine)
    values = samples(metrics)
    assert values["loom:spec_decode_num_draft_tokens_total"] == 20  # 10 from each engine
    assert values["loom:spec_decode_num_accepted_tokens_total"] == 9 + 1
    assert values['loom:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] == 6 + 1
    assert values['loom:spec_decode_num_accepted_tokens_per_pos_total{position="1"}'] == 3


def test_the_disk_tier_counts_its_hits_bytes_and_seconds() -> None:
    metrics = LoomMetrics()
    for scale in (1, 2):
        metrics.observe_step(StepStats(
            prefix_cache_hits_total=96 * scale, prefix_cache_disk_hits_total=64 * scale,
            kv_offload_read_bytes_total=4096 * scale, kv_offload_written_bytes_total=8192,
            kv_offload_read_seconds_total=0.5 * scale, kv_offload_write_seconds_total=0.25))
    values = samples(metrics)
    assert values["loom:prefix_cache_hits_total"] == 192
    assert values["loom:prefix_cache_disk_hits_total"] == 128
    assert values["loom:kv_offload_read_bytes_total"] == 8192
    assert values["loom:kv_offload_written_bytes_total"] == 8192
    assert values["loom:kv_offload_read_seconds_total"] == pytest.approx(1.0)
    assert values["loom:kv_offload_write_seconds_total"] == pytest.approx(0.25)


def test_a_restarted_engines_first_report_counts_whole() -> None:
    metrics = LoomMetrics()
    metrics.observe_step(StepStats(prefix_cache_hits_total=336, engine_start_time=1.0), 1)
    metrics.observe_step(StepStats(prefix_cache_hits_total=400, engine_start_time=1.0), 1)
    # A new process (local or remote): its first report already holds more than a step's
    # work, even as much as the old one's last.
    metrics.observe_step(StepStats(prefix_cache_hits_total=400, engine_start_time=2.0), 1)
    values = samples(metrics)
    assert values["loom:prefix_cache_hits_total"] == 400 + 400
    assert values['loom:engine_prefix_cache_hits_total{engine="1"}'] == 400 + 400
