"""The token embedding, split over the ranks by vocabulary: an id outside this rank's slice
looks up zeros, and the sum over the ranks restores it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.tensor_parallel import all_reduce, tp_shard
from engine.layers.linear import CheckpointTensor


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None,
                 ) -> None:
        self.shard = tp_shard()
        self.start, self.end = self.shard.vocab_span(vocab_size)
        super().__init__(self.end - self.start, hidden_size, dtype=dtype)
        self.requires_grad_(False)

    def reset_parameters(self) -> None:
        """Nothing: the weights come from the checkpoint. (nn.Embedding's random init, under
        the meta device, goes through torch's reference ops and imports dynamo: ~1.3 s.)"""

    def load(self, kind: str, tensor: CheckpointTensor, part: int | None) -> None:
        self.weight.data.copy_(tensor[self.start:self.end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return F.embedding(input_ids, self.weight)
        inside = (input_ids >= self.start) & (input_ids < self.end)
        local = (input_ids - self.start).clamp(0, max(self.end - self.start - 1, 0))
        embedded = F.embedding(local, self.weight) * inside[:, None].to(self.weight.dtype)
        return all_reduce(embedded)
