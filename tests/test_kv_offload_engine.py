"""The prefix cache's disk tier in the engine, on a tiny random Llama in fp32: blocks written
through to disk come back on a prefix hit, in the same engine once the pool evicted them and
in a new engine after a restart, with the same greedy output as a fresh prefill; a broken
file is a miss."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.sampling import SamplingParams
from engine.request import Request
from tests.engine_helpers import assert_no_leaks, greedy_request, make_core
from tests.model_fixtures import build_tiny_llama_dir

OFFLOAD_BYTES = 64 * 1024**2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(3 * i + 17 * salt) % 180 + 5 for i in range(length)]


def generate(core, prompt: list[int], max_tokens: int = 8) -> tuple[list[int], int]:
    """(the greedy output, the prompt tokens the cache supplied)."""
    request = greedy_request(prompt, max_tokens)
    core.add_request(request)
    tokens, cached = [], 0
    while core.has_work:
        for output in core.step().outputs:
            tokens += output.new_token_ids
            cached = output.num_cached_tokens
    assert_no_leaks(core)
    return tokens, cached


def offloading(model_dir: str, directory: Path, **settings):
    return make_core(model_dir, kv_offload_dir=str(directory), kv_offload_bytes=OFFLOAD_BYTES,
                     **settings)


def test_a_restarted_engine_hits_the_prompts_the_last_one_saw(model_dir: str,
                                                                tmp_path: Path) -> None:
    prompt = prompt_of(100)
    fresh, cached = generate(make_core(model_dir), prompt)
    assert cached == 0
    first = offloading(model_dir, tmp_path)
    assert generate(first, prompt) == (fresh, 0)
    first.shutdown()
    second = offloading(model_dir, tmp_path)
    assert generate(second, prompt) == (fresh, 96)  # six whole blocks from disk
    stats = second.idle_outputs().stats
    assert stats.prefix_cache_disk_hits_total == stats.prefix_cache_hits_total == 96
    assert stats.kv_offload_read_bytes_total > 0 and stats.kv_offload_read_seconds_total > 0
    second.shutdown()
    for path in tmp_path.rglob("*.kv"):
        path.write_bytes(path.read_bytes()[:-1] + b"\x7f")
    third = offloading(model_dir, tmp_path)
    assert generate(third, prompt) == (fresh, 0)  # broken files are misses ...
    assert third.disk_tier is not None and third.disk_tier.store.stats.corrupt >= 1
    third.shutdown()


def test_blocks_the_pool_evicted_come_back_from_disk(model_dir: str, tmp_path: Path) -> None:
    prompt = prompt_of(100, 1)
    fresh, _ = generate(make_core(model_dir), prompt)
    core = offloading(model_dir, tmp_path, num_kv_blocks=12)
    generate(core, prompt)
    core.disk_tier.store.flush()
    for salt in range(2, 5):  # other prompts take every pool block in turn
        generate(core, prompt_of(150, salt))
    probe = Request("probe", prompt, SamplingParams(max_tokens=1))
    assert not any(h in core.block_manager.cached[0]
                   for h in core.block_manager.block_hashes(probe))
    assert generate(core, prompt) == (fresh, 96)
    core.shutdown()


def test_the_tier_stays_off_with_sliding_window_layers(tmp_path: Path,
                                                                caplog) -> None:
    model = build_tiny_llama_dir(tmp_path / "gemma", "gemma3_text")
    core = offloading(model, tmp_path / "kv")
    assert core.disk_tier is None
    assert "KV disk tier off" in caplog.text


def test_an_int8_cache_keeps_its_blocks_apart_and_reads_them_back(model_dir: str,
                                                                  tmp_path: Path) -> None:
    """The tier's key names the codes: an int8 engine's entries are its own, a float engine on
    the same directory misses them, and a restarted int8 engine answers from them as cold."""
    prompt = prompt_of(100, 7)
    fresh, _ = generate(make_core(model_dir, kv_cache_dtype="int8"), prompt)
    first = offloading(model_dir, tmp_path, kv_cache_dtype="int8")
    assert generate(first, prompt) == (fresh, 0)
    first.shutdown()
    float_engine = offloading(model_dir, tmp_path)
    assert generate(float_engine, prompt)[1] == 0
    float_engine.shutdown()
    second = offloading(model_dir, tmp_path, kv_cache_dtype="int8")
    assert generate(second, prompt) == (fresh, 96)
    second.shutdown()
    assert len([path for path in tmp_path.iterdir() if path.is_dir()]) == 2  # two keys
