"""One API request fans out into one engine request per choice: n samples of each prompt.

Choice `k * n + i` is sample i of prompt k. With a seed, sample i uses seed + i, so the
samples differ yet each is reproducible, and sample 0 equals the same request with n=1.
"""

from __future__ import annotations

from dataclasses import replace

from common.protocol import AddRequest
from common.sampling import SamplingParams
from frontend.generation import Usage

SEED_SPAN = 2**64  # seeds wrap within [-(2**63), 2**64)


def sample_seed(seed: int | None, sample: int) -> int | None:
    if seed is None:
        return None
    shifted = seed + sample
    return shifted - SEED_SPAN if shifted >= SEED_SPAN else shifted


def choice_requests(
    request_id: str,
    prompts: list[list[int]],
    sampling: list[SamplingParams],  # per prompt
    n: int,
    arrival_time: float,
    priority: int = 0,
    tenant: str = "",
    tenant_weight: float = 1.0,
    timeout_s: float | None = None,
) -> list[AddRequest]:
    """Engine requests in choice-index order. A lone choice keeps the API request's id."""
    single = len(prompts) * n == 1
    requests = []
    for prompt_index, (prompt_ids, params) in enumerate(zip(prompts, sampling, strict=True)):
        for sample in range(n):
            index = prompt_index * n + sample
            sample_params = (
                params if sample == 0 else replace(params, seed=sample_seed(params.seed, sample))
            )
            requests.append(
                AddRequest(
                    request_id if single else f"{request_id}-{index}",
                    prompt_ids,
                    sample_params,
                    arrival_time,
                    priority,
                    tenant,
                    tenant_weight,
                    timeout_s,
                )
            )
    return requests


def total_usage(usages: list[Usage], n: int) -> Usage:
    """Completion tokens of every choice; each prompt counted once, not once per sample."""
    groups = [usages[start : start + n] for start in range(0, len(usages), n)]
    return Usage(
        prompt_tokens=sum(group[0].prompt_tokens for group in groups),
        completion_tokens=sum(usage.completion_tokens for usage in usages),
        cached_tokens=sum(min(usage.cached_tokens for usage in group) for group in groups),
    )
