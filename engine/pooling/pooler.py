"""Embedding requests (`SamplingParams.pooling`): their prompt's final hidden states (after
the model's last norm, as transformers' `hidden_states[-1]` has them) pooled over the chunks
that compute the prompt, then L2-normalized, as vLLM pools decoder models.

"last" takes the prompt's last token; "mean" sums every token's state chunk by chunk (a
chunk starting at position 0 restarts the sum: preemption recomputes from the start) and
divides by the prompt's length. A mean needs every token computed: the block manager
gives such requests no prefix-cache hit."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.request import Request


@dataclass(slots=True)
class PoolSpan:
    """One chunk's rows of a pooling request, as the runner computed them."""

    request_id: str
    kind: str  # "last" | "mean"
    first_row: int
    end_row: int
    start_position: int  # the chunk's first token's position in its request
    vector: torch.Tensor | None = None  # float32: the last row's state, or the rows' sum


def pool_rows(span: PoolSpan, hidden: torch.Tensor, norm: torch.nn.Module) -> None:
    first = span.first_row if span.kind == "mean" else span.end_row - 1
    span.vector = norm(hidden[first:span.end_row]).float().sum(0)


@dataclass(slots=True)
class Pooler:
    sums: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, spans: list[PoolSpan]) -> None:
        for span in spans:
            assert span.vector is not None
            seen = self.sums.get(span.request_id)
            if seen is None or span.start_position == 0 or span.kind == "last":
                self.sums[span.request_id] = span.vector
            else:
                self.sums[span.request_id] = seen + span.vector

    def embeddings(self, requests: list[Request]) -> dict[str, bytes]:
        """The vectors of the pooling requests among `requests` (those whose prompt this
        step finished computing)."""
        return {request.request_id: self.embedding(request) for request in requests
                if request.sampling.pooling is not None}

    def embedding(self, request: Request) -> bytes:
        """The finished prompt's vector, normalized, as float32 bytes (and forgotten)."""
        vector = self.sums.pop(request.request_id)
        if request.sampling.pooling == "mean":
            vector = vector / request.num_prompt_tokens
        vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.cpu().numpy().astype("<f4").tobytes()

    def forget(self, request_id: str) -> None:
        self.sums.pop(request_id, None)
