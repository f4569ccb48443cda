"""Prefill/decode disaggregation in the engine (engine.kv_transfer), two in-process engines on
a tiny random Llama in fp32: a prefill engine's exported blocks, handed to a decode engine
as the frontend relays them, let it continue a batch of requests after their first tokens
with transformers' greedy output, prefilling only what was not sent; blocks it already
holds are not kept twice, blocks of another layout or size are refused, and blocks nobody
claims go when their request is aborted."""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.protocol import AddRequest, KVBlocks
from engine.block_manager import ROOT_HASH, hash_block
from engine.core import EngineCore
from tests.engine_helpers import (
    assert_equals_transformers_generate,
    assert_no_leaks,
    greedy_request,
    make_core,
    reference_model,
)
from tests.model_fixtures import build_tiny_llama_dir

BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(7 * i + 13 * salt) % 180 + 5 for i in range(length)]


def chained_hashes(tokens: list[int]) -> list[bytes]:
    hashes, parent = [], ROOT_HASH
    for start in range(0, len(tokens) // BLOCK * BLOCK, BLOCK):
        parent = hash_block(parent, tuple(tokens[start:start + BLOCK]))
        hashes.append(parent)
    return hashes


def prefill_legs(core: EngineCore, requests: list[AddRequest], skip_blocks: int = 0,
                 ) -> tuple[dict[str, list[int]], list[tuple[KVBlocks, bytes]]]:
    """Each request's first token(s) from `core`, and the KV frames it sent, in order."""
    for request in requests:
        core.add_request(replace(request, sampling=replace(request.sampling, max_tokens=1),
                                 export_kv=True, kv_skip_blocks=skip_blocks))
    first: dict[str, list[int]] = {request.request_id: [] for request in requests}
    frames = []
    while core.has_work:
        outputs = core.step().outputs
        frames += core.kv_transfer.collect()
        for output in outputs:
            first[output.request_id] += output.new_token_ids
    assert_no_leaks(core)
    return first, frames


def decode_legs(core: EngineCore, requests: list[AddRequest], first: dict[str, list[int]],
                frames: list[tuple[KVBlocks, bytes]]) -> dict[str, list[int]]:
    for header, payload in frames:
        core.kv_transfer.receive(header, memoryview(payload))
    outputs = {request.request_id: list(first[request.request_id]) for request in requests}
    for request in requests:
        core.add_request(replace(request, output_token_ids=first[request.request_id]))
    while core.has_work:
        for output in core.step().outputs:
            outputs[output.request_id] += output.new_token_ids
    assert_no_leaks(core)
    return outputs


def test_a_decode_engine_continues_from_a_prefill_engines_blocks(model_dir: str) -> None:
    # Chunked prefills (budget 48) of prompts with and without a partial last block.
    requests = [greedy_request(prompt_of(length, salt), 12)
                for salt, length in enumerate([100, 64, 37, 130])]
    prefill = make_core(model_dir, max_num_batched_tokens=48)
    decode = make_core(model_dir, max_num_batched_tokens=48)
    first, frames = prefill_legs(prefill, requests)
    assert all(len(tokens) == 1 for tokens in first.values())
    sent = dict.fromkeys(first, 0)
    for header, _ in frames:
        sent[header.request_id] += len(header.block_hashes)
    assert sent == {request.request_id: len(request.prompt_token_ids) // BLOCK
                    for request in requests}
    assert len(frames) > len(requests), "blocks go out as chunks compute them"
    outputs = decode_legs(decode, requests, first, frames)
    assert_equals_transformers_generate(outputs, requests, reference_model(model_dir))
    stats = decode.idle_outputs().stats
    whole_blocks = sum(len(request.prompt_token_ids) // BLOCK * BLOCK for request in requests)
    # Every whole block came over: only the tail after it (and the first token) was computed.
    assert stats.prefix_cache_transfer_hits_total == stats.prefix_cache_hits_total == whole_blocks
    assert decode.kv_transfer.received is not None and not decode.kv_transfer.received.staged


def test_blocks_the_decode_engine_holds_are_not_kept_twice(model_dir: str) -> None:
    prompt = prompt_of(80, 9)
    request = greedy_request(prompt, 6)
    prefill, decode = make_core(model_dir), make_core(model_dir)
    warm = greedy_request(prompt[:50], 1)  # leaves three whole blocks cached
    decode.add_request(warm)
    while decode.has_work:
        decode.step()
    first, frames = prefill_legs(prefill, [request])
    assert decode.kv_transfer.received is not None
    for header, payload in frames:
        decode.kv_transfer.receive(header, memoryview(payload))
    assert len(decode.kv_transfer.received.staged) == 80 // BLOCK - 3
    outputs = decode_legs(decode, [request], first, [])
    assert_equals_transformers_generate(outputs, [request], reference_model(model_dir))


def test_blocks_the_decode_engine_was_sent_before_are_not_sent_again(model_dir: str) -> None:
    prompt = prompt_of(90, 4)
    request = greedy_request(prompt, 6)
    prefill, decode = make_core(model_dir), make_core(model_dir)
    decode.add_request(greedy_request(prompt[:40], 1))  # two whole blocks cached there
    while decode.has_work:
        decode.step()
    first, frames = prefill_legs(prefill, [request], skip_blocks=2)
    hashes = [h for header, _ in frames for h in header.block_hashes]
    assert hashes == chained_hashes(prompt)[2:]
    outputs = decode_legs(decode, [request], first, frames)
    assert_equals_transformers_generate(outputs, [request], reference_model(model_dir))
    stats = decode.idle_outputs().stats
    assert stats.prefix_cache_transfer_hits_total == 3 * BLOCK
    assert stats.prefix_cache_hits_total >= 5 * BLOCK


def test_blocks_of_another_layout_or_size_are_refused(model_dir: str) -> None:
    prefill = make_core(model_dir)
    decode = make_core(model_dir, dtype="bfloat16")  # another dtype: another layout
    request = greedy_request(prompt_of(40, 3), 5)
    first, frames = prefill_legs(prefill, [request])
    assert decode.kv_transfer.received is not None
    for header, payload in frames:
        decode.kv_transfer.receive(header, memoryview(payload))
        same_layout = replace(header, layout=decode.kv_transfer.received.layout)
        decode.kv_transfer.receive(same_layout, memoryview(payload)[:-1])  # torn
    received = decode.kv_transfer.received
    assert not received.staged and received.num_dropped == 2 * len(frames)
    outputs = decode_legs(decode, [request], first, [])  # recomputes: still right
    assert len(outputs[request.request_id]) == 5
    assert decode.idle_outputs().stats.prefix_cache_transfer_hits_total == 0


def test_an_abort_drops_the_blocks_nobody_claimed(model_dir: str) -> None:
    prefill, decode = make_core(model_dir), make_core(model_dir)
    request = greedy_request(prompt_of(70, 5), 5)
    _, frames = prefill_legs(prefill, [request])
    for header, payload in frames:
        decode.kv_transfer.receive(header, memoryview(payload))
    assert decode.kv_transfer.received is not None and decode.kv_transfer.received.num_bytes > 0
    decode.abort_requests([request.request_id])  # the client left before the decode leg
    assert not decode.kv_transfer.received.staged and decode.kv_transfer.received.num_bytes == 0
    assert_no_leaks(decode)


def test_an_aborted_prefill_leg_stops_exporting(model_dir: str) -> None:
    prefill = make_core(model_dir, max_num_batched_tokens=32)
    request = greedy_request(prompt_of(120, 6), 4)
    prefill.add_request(replace(request, export_kv=True))
    prefill.step()
    assert len(prefill.kv_transfer.collect()) == 1
    prefill.abort_requests([request.request_id])
    assert prefill.kv_transfer.exporter is not None and not prefill.kv_transfer.exporter.exports
    assert prefill.kv_transfer.collect() == []
    assert_no_leaks(prefill)
