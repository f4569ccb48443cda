"""bench.triton_attention on the CPU (Triton's interpreter: its dry run): every configuration
gets a row with a time, each problem's fastest one starred, and the tiles it sweeps give the
same attention (the torch reference agrees with the kernel at each)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is an optional dependency (pip install .[gpu])")

from bench.triton_attention import Launch, Shape, decode_problem, sweep
from engine.attention.triton_kernels import paged_attention


def test_a_row_per_configuration_and_one_star_per_problem() -> None:
    launches = [Launch(16, 4), Launch(32, 8)]
    lines = sweep([Shape.parse("4/2x16")], [2], [20, 40], launches, "cpu", torch.float32,
                  repeats=1)
    rows = [line.split("|")[1:-1] for line in lines[2:]]
    assert len(rows) == 2 * 2  # two contexts x two launches
    assert all(float(row[5]) > 0 for row in rows)
    assert sum("*" in row[4] for row in rows) == 2


def test_every_tile_gives_the_attention_of_the_scattered_blocks() -> None:
    problem = decode_problem(Shape(4, 2, 16), batch=3, context=50, device="cpu",
                             dtype=torch.float32, copies=2)
    q, table = problem.queries[1], problem.tables[1]
    assert not set(table.flatten().tolist()) & set(problem.tables[0].flatten().tolist())
    k = problem.k_cache[table.long()]  # [batch, blocks, kv, block, dim]
    v = problem.v_cache[table.long()]
    k, v = (cache.permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, :50] for cache in (k, v))
    k, v = (cache.repeat_interleave(2, dim=1) for cache in (k, v))  # GQA: 2 heads a KV head
    scores = torch.einsum("bhd,bhtd->bht", q, k) * 16**-0.5
    want = torch.einsum("bht,bhtd->bhd", scores.softmax(-1), v)
    for tile in (16, 32, 64):
        got = paged_attention(q, problem.k_cache, problem.v_cache, table, problem.rows,
                              16**-0.5, tile_tokens=tile)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
