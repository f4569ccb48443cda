"""Model runner: every scheduled token of every request in ONE forward pass over the paged cache."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata
from engine.compiled_forward import Forward, compile_forward, timed_warm_up
from engine.forward_context import forward_context
from engine.scheduler import ScheduledChunk


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * block_size * element_size


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, compiled: bool = False) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        shape = model.kv_cache_shape(num_blocks, block_size)
        # Zeroed, not empty: padded tails of blocks are read (and masked) by attention.
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(model.num_layers)
        ]
        self.forward: Forward = model
        if compiled:
            self.forward = compile_forward(model)
            timed_warm_up(self._placeholder_step)

    @torch.inference_mode()
    def _placeholder_step(self, num_tokens: int) -> None:
        """`num_tokens` one-token decodes at position 0 of block 0 (free before any request):
        what a step of that many tokens compiles, writing nothing a request will read."""
        metadata = AttentionMetadata.build([1] * num_tokens, [1] * num_tokens,
                                           [[0]] * num_tokens, [0] * num_tokens,
                                           self.block_size, self.device)
        zeros = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        with forward_context(metadata):
            self.forward(zeros, zeros, self.kv_caches)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """Runs the step; returns the chunks that sample a token and their float32 logits."""
        # Decodes first, then prefill chunks: attention can treat the two groups separately.
        ordered = sorted(chunks, key=lambda chunk: chunk.num_tokens > 1)
        token_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_lens, seq_lens, block_tables = [], [], []
        sample_rows: list[int] = []
        sampling_chunks: list[ScheduledChunk] = []
        block_size = self.block_size
        for chunk in ordered:
            request = chunk.request
            start = request.num_computed_tokens
            end = start + chunk.num_tokens
            token_ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            table = request.block_table
            slot_mapping.extend(table[p // block_size] * block_size + p % block_size
                                for p in range(start, end))
            query_lens.append(chunk.num_tokens)
            seq_lens.append(end)
            block_tables.append(table)
            if chunk.completes_sequence:
                sample_rows.append(len(token_ids) - 1)
                sampling_chunks.append(chunk)
        metadata = AttentionMetadata.build(query_lens, seq_lens, block_tables, slot_mapping,
                                           block_size, self.device)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        position_ids = torch.tensor(positions, dtype=torch.long, device=self.device)
        with forward_context(metadata):
            hidden = self.forward(input_ids, position_ids, self.kv_caches)
        if not sample_rows:
            return [], hidden.new_empty((0, 0), dtype=torch.float32)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return sampling_chunks, self.model.compute_logits(hidden.index_select(0, rows))
