"""Drafts from a smaller model sharing the tokenizer (vLLM's "draft_model" method), run in the
engine beside the target.

Its KV cache has a tensor per layer of its own over the same block ids as the target's: a
block holds both models' keys and values for its tokens, so the block manager accounts for
the draft's memory (each block costs both models' bytes), prefix-cache hits serve both,
and rejected drafts' slots go back with the target's. The draft computes every token the
target computes, in the same step: first the step's chunks (prompt chunks, and each
decode's last token, whose logits give the first draft), then one token at a time each
drafted decode's next draft, writing its K/V down to the last draft. So its cache is valid
wherever the target's is, and a block cached by one request serves another's drafts.

Drafts are the draft model's argmax: point masses, which verification (engine.speculative
.verify) keeps exact for any target sampling. A grammar cuts a constrained request's drafts
at the first token it forbids."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from common.config import EngineConfig
from common.default_model import resolve_model
from engine.executor.model_runner import (
    ModelRunner,
    StepInputs,
    kv_bytes_per_block,
    slots_of,
)
from engine.kv_cache_groups import KVCacheLayout
from engine.request import Request
from engine.sampling.sampler import greedy_tokens
from engine.scheduler import ScheduledChunk
from engine.speculative.speculator import PLACEHOLDER
from engine.weights.loader import load_model

logger = logging.getLogger("loom.engine")


@dataclass(slots=True)
class PendingDraft:
    """A chunk whose drafts the draft model is producing: its last known token at
    `position`, the drafts so far."""

    chunk: ScheduledChunk
    position: int

    @property
    def request(self) -> Request:
        return self.chunk.request

    @property
    def wanted(self) -> int:
        return len(self.chunk.draft_token_ids)


class DraftModel:
    def __init__(self, model_path: str, target_vocab_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        directory = resolve_model(model_path, progress=logger.info)
        self.model = load_model(directory, dtype, device)
        self.device, self.dtype = device, dtype
        vocab = self.model.config.vocab_size
        if vocab > target_vocab_size:
            raise ValueError(f"the draft model's vocabulary ({vocab} tokens) is larger than the "
                             f"served model's ({target_vocab_size}): not the same tokenizer")
        if self.model.config.layer_windows and any(self.model.config.layer_windows):
            raise ValueError("a draft model with sliding-window layers is not supported")
        self.runner: ModelRunner | None = None
        logger.info("draft model %s: %d layers", model_path, self.model.num_layers)

    @classmethod
    def for_config(cls, config: EngineConfig, layout: KVCacheLayout, vocab_size: int,
                   dtype: torch.dtype, device: torch.device) -> DraftModel | None:
        """The draft model --speculative-config names, if it names one."""
        spec = config.speculative
        if spec is None or spec.method != "draft_model":
            return None
        if config.tensor_parallel_size > 1 or layout.num_groups > 1:
            raise ValueError("a draft model needs one tensor-parallel rank and a served model "
                             "whose layers share one block table (no hybrid KV cache)")
        return cls(spec.model, vocab_size, dtype, device)

    def bytes_per_block(self, block_size: int) -> int:
        model = self.model
        return kv_bytes_per_block(model.num_layers, model.num_local_kv_heads,
                                  model.config.head_dim, block_size, self.dtype)

    def start(self, num_blocks: int, block_size: int, max_model_len: int,
              max_num_seqs: int) -> None:
        """Its KV cache, over the target's `num_blocks` block ids."""
        self.runner = ModelRunner(self.model, num_blocks, block_size, self.device, self.dtype,
                                  max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                  layout=KVCacheLayout.single(self.model.num_layers))

    # --- the DraftSource protocol: slots first, tokens once the step is scheduled ----------
    def propose(self, request: Request, max_drafts: int) -> list[int]:
        return [PLACEHOLDER] * max_drafts

    def finished(self, request: Request) -> None:
        pass

    @torch.inference_mode()
    def fill(self, chunks: list[ScheduledChunk]) -> None:
        """Runs the draft over the step's chunks and writes each chunk's drafts in place."""
        assert self.runner is not None, "start() first"
        known = [ScheduledChunk(chunk.request, chunk.num_known_tokens) for chunk in chunks]
        inputs = StepInputs.gather(known, self.runner.block_size)
        pending = {id(chunk.request): PendingDraft(chunk, chunk.request.num_tokens - 1)
                   for chunk in chunks if chunk.draft_token_ids}
        drafting = [pending[id(c.request)] for c in inputs.sampling_chunks
                    if id(c.request) in pending]
        logits = self.runner.run(inputs, float32_logits=False)
        rows = [row for row, c in enumerate(inputs.sampling_chunks) if id(c.request) in pending]
        tokens = greedy_tokens(logits[rows]).tolist() if rows else []
        step = 0
        while drafting:
            for draft, token in zip(drafting, tokens, strict=True):
                draft.chunk.draft_token_ids[step] = token
            step += 1
            # Each draft's K/V is written (the last one's too): the cache stays complete.
            writing = [d for d in drafting if d.wanted >= step]
            tokens = self._next_tokens(writing, step)
            drafting = [d for d in writing if d.wanted > step]
            tokens = [t for d, t in zip(writing, tokens, strict=True) if d.wanted > step]

    def _next_tokens(self, drafts: list[PendingDraft], step: int) -> list[int]:
        """One decode of each chunk's latest draft (at its position + step)."""
        if not drafts:
            return []
        block_size = self.runner.block_size
        positions = [d.position + step for d in drafts]
        tables = [d.request.block_tables[0] for d in drafts]
        slots = [slot for table, p in zip(tables, positions, strict=True)
                 for slot in slots_of(table, p, p + 1, block_size)]
        inputs = StepInputs(token_ids=[d.chunk.draft_token_ids[step - 1] for d in drafts],
                            positions=positions, slot_mappings=[slots],
                            query_lens=[1] * len(drafts),
                            seq_lens=[p + 1 for p in positions], block_tables=[tables],
                            sample_rows=list(range(len(drafts))))
        return greedy_tokens(self.runner.run(inputs, float32_logits=False)).tolist()
