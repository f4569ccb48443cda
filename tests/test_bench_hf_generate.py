"""bench.hf_generate's batching: consecutive batches of the prompts, the first N of them with
--max-batches, output tokens counted from what generate returns (a scripted model stands in
for transformers')."""

from __future__ import annotations

import torch

from bench.hf_generate import run_batches


class ScriptedTokenizer:
    def __call__(self, prompts: list[str], **_: object) -> ScriptedTokenizer:
        self.batch = {"input_ids": torch.zeros(len(prompts), 3, dtype=torch.long)}
        return self

    def to(self, _device: object) -> dict[str, torch.Tensor]:
        return self.batch


class ScriptedModel:
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.batches: list[int] = []

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **_: object) -> torch.Tensor:
        self.batches.append(len(input_ids))
        return torch.zeros(len(input_ids), input_ids.shape[1] + max_new_tokens)


def test_batches_run_in_order_and_max_batches_stops_early() -> None:
    prompts = [f"prompt {i}" for i in range(10)]
    model = ScriptedModel()
    assert run_batches(model, ScriptedTokenizer(), prompts, 4, 5) > 0
    assert model.batches == [4, 4, 2]  # every prompt, the last batch short
    model.batches.clear()
    run_batches(model, ScriptedTokenizer(), prompts, 1, 5, max_batches=3)
    assert model.batches == [1, 1, 1]
