"""Drive an in-process EngineCore the way the engine process does, for engine-tier tests."""

from __future__ import annotations

import functools
import itertools
from concurrent.futures import wait
from typing import Literal

import torch

from common.config import EngineConfig
from common.protocol import AddRequest
from common.sampling import SamplingParams
from engine.core import EngineCore
from engine.executor.cuda_graphs import Recorder

_ids = itertools.count()


def make_core(model_dir: str, recorder: Recorder | Literal["auto"] | None = "auto",
              **overrides) -> EngineCore:
    settings = {"dtype": "float32", "device": "cpu", "kv_cache_memory": 64 * 1024**2}
    settings.update(overrides)
    return EngineCore(EngineConfig(model=model_dir, **settings), record_traces=True,
                      recorder=recorder)


def greedy_request(prompt: list[int], max_tokens: int, request_id: str | None = None,
                   **sampling) -> AddRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling)
    return AddRequest(request_id or f"req-{next(_ids)}", prompt, params, 0.0)


def run_to_completion(core: EngineCore, requests: list[AddRequest], max_steps: int = 100_000,
                      finish_reasons: dict[str, str] | None = None) -> dict[str, list[int]]:
    """Adds every request, steps until idle; returns each request's output token ids (and
    fills `finish_reasons` when given). Constrained requests join once their grammar is
    built, as in the engine process."""
    for request in requests:
        core.add_request(request)
    outputs: dict[str, list[int]] = {request.request_id: [] for request in requests}
    finished: set[str] = set()
    reasons = {} if finish_reasons is None else finish_reasons
    for _ in range(max_steps):
        assert core.admit_constrained() == []
        if not core.has_work:
            if not core.num_awaiting_grammar:
                break
            wait([build.future for waiting in core.awaiting_grammar.values()
                  for build in waiting.builds], timeout=60)
            continue
        for output in core.step().outputs:
            assert output.request_id not in finished, "tokens after the finish"
            outputs[output.request_id].extend(output.new_token_ids)
            if output.finish_reason is not None:
                finished.add(output.request_id)
                reasons[output.request_id] = output.finish_reason
    assert not core.has_work and not core.num_awaiting_grammar, "engine did not drain"
    assert finished == set(outputs), "some requests never finished"
    assert_no_leaks(core)
    return outputs


def assert_no_leaks(core: EngineCore) -> None:
    assert core.check_integrity() == []
    if not core.has_work:
        assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def top2_margin(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def assert_greedy_equal_or_near_tie(actual: list[int], expected: list[int], prompt: list[int],
                                    next_token_logits, tolerance: float = 1e-3) -> None:
    """Token-for-token equality; at the first divergence, the reference's top-2 logit margin
    must be below `tolerance` (a near tie that fp rounding may flip), else the test fails.
    `next_token_logits(token_ids)` returns the reference logits after `token_ids`."""
    assert len(actual) == len(expected)
    for index, (got, want) in enumerate(zip(actual, expected, strict=True)):
        if got == want:
            continue
        margin = top2_margin(next_token_logits(prompt + expected[:index]))
        assert margin < tolerance, (
            f"diverged at output token {index}: got {got}, expected {want}, "
            f"but the reference's top-2 margin is {margin:.2e} (>= {tolerance})")
        return


def assert_equals_transformers_generate(outputs: dict[str, list[int]],
                                        batch: list[AddRequest], reference,
                                        batched: bool = False) -> None:
    """Each request's greedy output equals `reference.generate` on its prompt alone (or, with
    `batched`, in one left-padded generate of every prompt: one pass over the weights per
    token for all), or diverges only where the reference's top two logits nearly tie."""

    def reference_logits(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return reference(torch.tensor([token_ids])).logits[0, -1]

    expected = (generate_batched(reference, batch) if batched else
                [generate_batched(reference, [request])[0] for request in batch])
    for request, want in zip(batch, expected, strict=True):
        assert_greedy_equal_or_near_tie(outputs[request.request_id], want,
                                        request.prompt_token_ids, reference_logits)


def generate_batched(reference, batch: list[AddRequest]) -> list[list[int]]:
    """Greedy `generate` of every prompt at once, left-padded (the longest max_tokens: each
    request keeps its own first max_tokens); one prompt alone has no padding."""
    longest = max(len(request.prompt_token_ids) for request in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, request in enumerate(batch):
        prompt = request.prompt_token_ids
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    with torch.no_grad():
        generated = reference.generate(
            ids, attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0,
            max_new_tokens=max(request.sampling.max_tokens for request in batch))
    return [generated[row, longest:longest + request.sampling.max_tokens].tolist()
            for row, request in enumerate(batch)]


@functools.cache
def reference_model(model_dir: str):
    """transformers' own model of a test's checkpoint, in fp32, loaded once."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_embedding(model_dir: str, prompt: list[int], kind: str):
    """transformers' final hidden states of the prompt (fp32), pooled as `kind` ("last" or
    "mean") and L2-normalized: the oracle of embedding requests."""
    model = reference_model(model_dir)
    with torch.no_grad():
        states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    pooled = states[-1] if kind == "last" else states.mean(0)
    return torch.nn.functional.normalize(pooled, dim=0).numpy()
