"""bench.serve against a tiny-model Loom started through launch.py, and a canned server."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.datasets import BenchTokenizer, DatasetSpec, build_dataset
from bench.launched import REPO_ROOT, LoomServer
from bench.metrics import Slo, histogram_view, parse_prometheus
from bench.run_result import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, ServeConfig
from bench.serve import arrival_offsets, run_benchmark
from tests.canned_server import CannedSettings, running
from tests.tiny_server import build_answer_model

DISTRIBUTIONS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
STATS = ("mean", "median", "p90", "p99", "max")
SCALARS = ("completed", "failed", "duration_s", "request_throughput", "output_throughput",
           "total_token_throughput", "total_input_tokens", "total_output_tokens",
           "total_output_tokens_usage", "output_token_mismatches", "max_concurrency_seen",
           "goodput_requests", "goodput_request_throughput")

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_answer_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def loom(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoomServer]:
    server = LoomServer(["--model", tiny_model, "--dtype", "float32", "--num-kv-blocks", "256"],
                        log_dir=tmp_path_factory.mktemp("logs"))
    with server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(tiny_model: str) -> BenchTokenizer:
    return BenchTokenizer.load(tiny_model)


def test_cli_report_against_loom(loom: LoomServer, tiny_model: str, tmp_path: Path) -> None:
    num_prompts, output_len = 6, 12
    report, plots = tmp_path / "run.json", tmp_path / "plots"
    completed = subprocess.run(
        [sys.executable, "-m", "bench.serve", "--base-url", loom.base_url,
         "--endpoint", CHAT_ENDPOINT, "--tokenizer", tiny_model, "--dataset", "prompts",
         "--num-prompts", str(num_prompts), "--output-len", str(output_len),
         "--max-concurrency", "3", "--ignore-eos", "--slo", "ttft=60000,tpot=60000",
         "--save-json", str(report), "--plot", str(plots), "--no-progress"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    assert "Serving Benchmark Result" in completed.stdout
    result = json.loads(report.read_text())
    for key in SCALARS:
        assert result[key] is not None, key
    for name in DISTRIBUTIONS:
        for stat in STATS:
            assert result[name][stat] is not None, f"{name}.{stat}"
    assert "server_metrics" in result and "step_time" in result
    assert result["completed"] + result["failed"] == num_prompts
    assert result["completed"] == num_prompts
    requests = result["requests"]
    assert len(requests) == num_prompts
    assert result["total_output_tokens"] == sum(r["usage_output_tokens"] for r in requests)
    assert result["total_output_tokens"] == result["total_output_tokens_usage"]
    assert result["total_output_tokens"] == num_prompts * output_len
    assert result["output_token_mismatches"] == 0
    assert [r["prompt_len"] for r in requests] == [r["usage_prompt_tokens"] for r in requests]
    assert result["goodput_requests"] == num_prompts
    assert result["max_concurrency_seen"] <= 3
    assert result["step_time"]["count"] > 0  # Loom's /metrics step-time histogram was read
    assert sorted(p.name for p in plots.iterdir()) == [
        "concurrency.png", "itl_cdf.png", "step_time.png", "throughput.png", "ttft_cdf.png"]


@pytest.mark.parametrize("dataset", ["random", "shared-prefix"])
async def test_completions_at_a_request_rate(loom: LoomServer, tokenizer: BenchTokenizer,
                                             dataset: str) -> None:
    spec = DatasetSpec(name=dataset, num_prompts=5, input_len=40, output_len=6,
                       range_ratio=0.3, prefix_len=48, seed=3)
    samples = build_dataset(spec, tokenizer)
    config = ServeConfig(base_url=loom.base_url + "/v1", endpoint=COMPLETIONS_ENDPOINT,
                         request_rate=40.0, burstiness=0.5, progress=False, ignore_eos=True)
    result = await run_benchmark(config, spec, samples, tokenizer)
    metrics = result.metrics
    assert (metrics.completed, metrics.failed) == (5, 0)
    assert metrics.total_output_tokens == sum(s.output_len for s in samples)
    assert metrics.output_token_mismatches == 0
    assert [r.prompt_len for r in result.records] == [r.usage_prompt_tokens
                                                      for r in result.records]


async def test_canned_server_accounting(tokenizer: BenchTokenizer) -> None:
    num_prompts, output_len = 40, 64
    spec = DatasetSpec(name="random", num_prompts=num_prompts, input_len=16,
                       output_len=output_len)
    samples = build_dataset(spec, tokenizer)
    async with running(CannedSettings(metrics=True)) as (url, _):
        config = ServeConfig(base_url=url, endpoint=CHAT_ENDPOINT, max_concurrency=8,
                             progress=False)
        result = await run_benchmark(config, spec, samples, tokenizer)
    metrics = result.metrics
    assert (metrics.completed, metrics.failed) == (num_prompts, 0)
    assert metrics.total_output_tokens == num_prompts * output_len
    assert metrics.total_output_tokens_usage == num_prompts * output_len
    assert sum(len(r.itls) for r in result.records) == num_prompts * (output_len - 1)
    assert 1 <= metrics.max_concurrency_seen <= 8
    assert result.server["counters"] == {"loom:requests_total": num_prompts}
    assert result.step_time is not None
    assert result.step_time.count == num_prompts * output_len  # the warm-up came before
    assert result.step_time.p99_ms == pytest.approx(4.96)


async def test_failed_requests_are_counted(tokenizer: BenchTokenizer) -> None:
    spec = DatasetSpec(name="random", num_prompts=12, input_len=8, output_len=4)
    samples = build_dataset(spec, tokenizer)
    async with running(CannedSettings(fail_every=4)) as (url, _):
        config = ServeConfig(base_url=url, warmup=False, progress=False, max_concurrency=1)
        result = await run_benchmark(config, spec, samples, tokenizer)
    assert (result.metrics.completed, result.metrics.failed) == (9, 3)
    assert result.errors() == {"HTTP 500: canned failure": 3}
    assert result.server is None and result.step_time is None
    assert result.to_dict()["failed"] == 3


def test_arrivals_follow_the_rate() -> None:
    assert arrival_offsets(4, math.inf, 1.0, 0) == [0.0] * 4
    for burstiness in (1.0, 0.3):
        offsets = arrival_offsets(4001, 20.0, burstiness, seed=1)
        assert offsets == sorted(offsets)
        assert offsets[-1] / 4000 == pytest.approx(1 / 20, rel=0.1)


def test_slo_and_histogram_parsing() -> None:
    assert Slo.parse("ttft=500,tpot=50") == Slo(ttft=500.0, tpot=50.0)
    with pytest.raises(ValueError):
        Slo.parse("latency=3")
    before = parse_prometheus('loom:step_time_seconds_bucket{le="0.01"} 2\n'
                              'loom:step_time_seconds_bucket{le="+Inf"} 2\n'
                              "loom:step_time_seconds_sum 0.01\n")
    after = parse_prometheus('# TYPE loom:step_time_seconds histogram\n'
                             'loom:step_time_seconds_bucket{le="0.01"} 6\n'
                             'loom:step_time_seconds_bucket{le="+Inf"} 12\n'
                             "loom:step_time_seconds_sum 0.51\n"
                             "vllm:other 3\n")
    view = histogram_view(before, after)
    assert (view.count, view.mean_ms) == (10, pytest.approx(50.0))
    assert view.buckets == [(0.01, 4), (math.inf, 6)]
    assert view.p50_ms == pytest.approx(10.0)  # the +Inf bucket reports its lower bound
    assert histogram_view(None, parse_prometheus("loom:other 1\n")) is None


def test_exported_prompts_replay_as_the_same_workload(tiny_model: str,
                                                      tokenizer: BenchTokenizer,
                                                      tmp_path: Path) -> None:
    source = tmp_path / "source.jsonl"
    source.write_text(json.dumps({"kind": "chat", "prompt": "Say hi.", "system": "Be terse."})
                      + "\n" + json.dumps({"kind": "chat", "prompt": "Count to 3."}) + "\n")
    exported = tmp_path / "exported.jsonl"
    subprocess.run([sys.executable, "-m", "bench.serve", "--tokenizer", tiny_model,
                    "--dataset", "prompts", "--prompts-file", str(source), "--num-prompts", "2",
                    "--output-len", "7", "--endpoint", CHAT_ENDPOINT,
                    "--export-prompts", str(exported)], check=True, cwd=REPO_ROOT)
    lines = [json.loads(line) for line in exported.read_text().splitlines()]
    # What vllm bench serve's custom dataset reads: the system message folded into the prompt.
    assert sorted(line["prompt"] for line in lines) == ["Be terse.\n\nSay hi.", "Count to 3."]
    assert all(line["output_tokens"] == 7 and line["kind"] == "chat" for line in lines)
    replayed = build_dataset(DatasetSpec("prompts", num_prompts=2, prompts_file=exported,
                                         chat=True), tokenizer)
    assert sorted(sample.prompt for sample in replayed) == sorted(line["prompt"] for line in lines)
    assert all(sample.system is None for sample in replayed)
