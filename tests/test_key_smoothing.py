"""Balanced keys of 8-bit caches (engine.attention.key_smoothing): the tables change no
attention weight, make 8-bit keys more precise where keys and queries are far from isotropic
(along channels or not), and every runner on the same weights derives the same ones (a stored
block means one thing)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention.key_smoothing import KeySmoothing, KeyStatistics, fingerprint
from engine.attention.quantized_kv import rotate, round_trip
from engine.executor.model_runner import ModelRunner, attention_layers
from engine.kv_blocks import payload_layout
from engine.weights.loader import load_model
from tests.model_fixtures import build_tiny_llama_dir

KV_HEADS, GROUP, DIM = 2, 3, 16


def channel_profile(generator: torch.Generator,
                    turned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys whose channels span 0.05..8 around a mean, queries larger where keys are small;
    `turned`: both in directions other than the channels' (one random rotation)."""
    sizes = torch.logspace(-1.3, 0.9, DIM)[torch.randperm(DIM, generator=generator)]
    keys = torch.randn(256, KV_HEADS, DIM, generator=generator) * sizes + 2 * sizes
    queries = torch.randn(256, KV_HEADS * GROUP, DIM, generator=generator) / sizes.sqrt()
    if turned:
        rotation = torch.linalg.qr(torch.randn(DIM, DIM, generator=generator))[0]
        keys, queries = keys @ rotation, queries @ rotation
    return queries, keys


def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[kv_heads, group, T_q, T_k] of q [T, heads, D], k [T, kv_heads, D]."""
    grouped = q.view(q.shape[0], KV_HEADS, GROUP, DIM).permute(1, 2, 0, 3)
    return grouped @ k.permute(1, 2, 0)[:, None]


def tables_for(queries: torch.Tensor, keys: torch.Tensor, shift: bool = True) -> KeySmoothing:
    statistics = KeyStatistics()
    half = len(keys) // 2  # statistics add up over steps
    statistics.observe(queries[:half], keys[:half])
    statistics.observe(queries[half:], keys[half:])
    return statistics.smoothing(shift=shift)


def test_smoothing_changes_no_attention_weight() -> None:
    queries, keys = channel_profile(torch.Generator().manual_seed(0))
    tables = tables_for(queries, keys)
    assert tables.key_offset.abs().max() > 0.1, "keys with a mean are shifted"
    q, k = tables.apply(queries, keys)
    torch.testing.assert_close(scores(q, k).softmax(-1), scores(queries, keys).softmax(-1),
                               atol=1e-6, rtol=1e-5)
    # Without the shift every score is the same number, to float32 rounding.
    unshifted = tables_for(queries, keys, shift=False)
    assert torch.count_nonzero(unshifted.key_offset) == 0
    torch.testing.assert_close(scores(*unshifted.apply(queries, keys)), scores(queries, keys),
                               atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(unshifted.keys_back(unshifted.keys(keys)), keys,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("turned", [False, True], ids=["along channels", "turned"])
def test_balanced_int8_keys_move_attention_weights_less(turned: bool) -> None:
    """Here the tables without the shift cut the error 7-8x, and the shift 1.3-1.6x more,
    whether the keys' large directions are channels or not (turned, the channels are about
    equally large: a per-channel scale would have nothing to work on)."""
    queries, keys = channel_profile(torch.Generator().manual_seed(1), turned)
    exact = scores(queries, keys).softmax(-1)

    def error(q: torch.Tensor, k: torch.Tensor) -> float:
        held = rotate(round_trip(rotate(k), torch.int8))  # as an int8 cache gives keys back
        return (scores(q, held).softmax(-1) - exact).abs().mean().item()

    plain = error(queries, keys)
    scaled = error(*tables_for(queries, keys, shift=False).apply(queries, keys))
    smoothed = error(*tables_for(queries, keys).apply(queries, keys))
    assert scaled < plain / 5 and smoothed < scaled / 1.25, (plain, scaled, smoothed)


def test_a_silent_layer_gets_finite_tables() -> None:
    zeros = torch.zeros(8, KV_HEADS, DIM)
    tables = tables_for(torch.zeros(8, KV_HEADS * GROUP, DIM), zeros)
    for table in (tables.query_matrix, tables.key_matrix, tables.key_offset):
        assert torch.isfinite(table).all()
    assert torch.equal(tables.query_matrix, torch.eye(DIM).expand(KV_HEADS, DIM, DIM))


def test_a_head_whose_statistics_overflowed_gets_plain_rows() -> None:
    queries, keys = channel_profile(torch.Generator().manual_seed(2))
    statistics = KeyStatistics()
    statistics.observe(queries, keys)
    assert statistics.query_products is not None
    statistics.query_products[1, 0, 0] = float("inf")
    tables = statistics.smoothing(shift=True)
    for table in (tables.query_matrix, tables.key_matrix, tables.key_offset):
        assert torch.isfinite(table).all()
    assert torch.equal(tables.query_matrix[1], torch.eye(DIM))
    assert torch.equal(tables.key_matrix[1], torch.eye(DIM))
    assert not torch.equal(tables.query_matrix[0], torch.eye(DIM))


def runner_tables(model_dir: Path, cache: torch.dtype, num_blocks: int = 20,
                  ) -> tuple[ModelRunner, list[KeySmoothing | None]]:
    model = load_model(str(model_dir), torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, num_blocks, 16, torch.device("cpu"), torch.float32,
                         cache_dtype=cache)
    return runner, [layer.key_smoothing for layer in attention_layers(model)]


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_runners_on_the_same_weights_derive_the_same_tables(model_type: str,
                                                            tmp_path: Path) -> None:
    model_dir = build_tiny_llama_dir(tmp_path, model_type)
    first, tables = runner_tables(model_dir, torch.int8)
    second, again = runner_tables(model_dir, torch.int8)
    assert all(table is not None for table in tables)
    assert first.kv_meaning == second.kv_meaning != ""
    for table, other in zip(tables, again, strict=True):
        assert torch.equal(table.key_offset, other.key_offset)
        assert torch.equal(table.query_matrix, other.query_matrix)
        assert torch.equal(table.key_matrix, other.key_matrix)
    capped = [layer.softcap is not None for layer in attention_layers(first.model)]
    for table, is_capped in zip(tables, capped, strict=True):
        # softmax ignores a shift common to all keys; a soft cap does not
        assert (torch.count_nonzero(table.key_offset) == 0) == is_capped
    assert any(capped) == (model_type == "gemma2")


def test_a_plain_cache_has_no_tables_and_other_tables_name_other_blocks(tmp_path: Path) -> None:
    model_dir = build_tiny_llama_dir(tmp_path)
    plain, tables = runner_tables(model_dir, torch.float32)
    assert plain.kv_meaning == "" and not any(tables)
    runner, tables = runner_tables(model_dir, torch.int8)
    fewer, _ = runner_tables(model_dir, torch.int8, num_blocks=3)  # one sampled text of 48
    assert fewer.kv_meaning != runner.kv_meaning
    doubled = [KeySmoothing(t.query_matrix * 2, t.key_matrix / 2, t.key_offset / 2)
               for t in tables]
    assert fingerprint(doubled) != runner.kv_meaning
    names = {payload_layout(str(model_dir), torch.float32, 16, runner.kv_caches, meaning)
             for meaning in (runner.kv_meaning, fewer.kv_meaning)}
    assert len(names) == 2
