"""Model runner: every scheduled token of every request in ONE forward pass over the paged cache."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.attention.forward_context import forward_context
from engine.attention.key_smoothing import (
    CALIBRATION_LENGTH,
    CALIBRATION_SEED,
    CALIBRATION_SEQUENCES,
    KeyStatistics,
    fingerprint,
)
from engine.attention.quantized_kv import is_quantized, row_width
from engine.attention.workspace import Workspace
from engine.distributed.tensor_parallel import broadcast_step
from engine.executor.compiled_forward import Forward, compile_forward, timed_warm_up
from engine.executor.cuda_graphs import DecodeGraphs, Recorder
from engine.executor.decode_tapes import DecodeTapes
from engine.executor.kernel_choice import KernelChoice
from engine.kv_cache_groups import KVCacheLayout
from engine.layers.attention import PagedAttention
from engine.layers.pinned_attributes import pin_attributes
from engine.platform.host_copy import int_tensor
from engine.platform.huge_pages import PagesAhead, skews, zeros_on_huge_pages
from engine.pooling.pooler import PoolSpan, pool_rows
from engine.scheduler import ScheduledChunk


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype) -> int:
    """`dtype`: the cache's (8-bit codes: their rows carry a scale each)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * row_width(head_dim, dtype) * block_size * element_size


def slots_of(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The cache slots of positions start..end-1 of a request with this block table."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


# KV cache bytes whose pages are mapped at start, and then ahead of the blocks steps write
# (engine.platform.huge_pages.PagesAhead): a W1 run at concurrency 64 on the default model
# stays inside the first stretch.
PREFAULT_BYTES = 512 << 20


@dataclass(slots=True)
class StepInputs:
    """The step's flattened batch as Python lists: decodes first, then prefill chunks. Slot
    mappings and block tables come one per KV cache group (engine.kv_cache_groups)."""

    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mappings: list[list[int]] = field(default_factory=list)  # [group][token]
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[list[int]]] = field(default_factory=list)  # [group][request]
    sample_rows: list[int] = field(default_factory=list)  # the rows whose logits are sampled
    sampling_chunks: list[ScheduledChunk] = field(default_factory=list)
    has_prompt_rows: bool = False  # a chunk computes more than one token of its request's own
    drafted: list[int] = field(default_factory=list)  # requests (in step order) with drafts
    pooling: list[PoolSpan] = field(default_factory=list)  # embedding requests' rows (rank 0)

    @classmethod
    def gather(cls, chunks: list[ScheduledChunk], block_size: int,
               num_groups: int = 1) -> StepInputs:
        # Decodes first, then prefill chunks and drafted decodes: attention can treat the
        # two groups separately. A drafted decode samples its last token's row and its
        # drafts' rows.
        inputs = cls(slot_mappings=[[] for _ in range(num_groups)],
                     block_tables=[[] for _ in range(num_groups)])
        for chunk in sorted(chunks, key=lambda chunk: chunk.num_tokens > 1):
            request = chunk.request
            start = request.num_computed_tokens
            end = start + chunk.num_tokens
            inputs.token_ids.extend(request.token_ids[start:start + chunk.num_known_tokens])
            inputs.token_ids.extend(chunk.draft_token_ids)
            inputs.positions.extend(range(start, end))
            for table, slots, tables in zip(request.block_tables, inputs.slot_mappings,
                                            inputs.block_tables, strict=True):
                slots.extend(slots_of(table, start, end, block_size))
                tables.append(table)
            inputs.query_lens.append(chunk.num_tokens)
            inputs.seq_lens.append(end)
            inputs.has_prompt_rows |= chunk.num_known_tokens > 1
            if chunk.draft_token_ids:
                inputs.drafted.append(len(inputs.query_lens) - 1)
            if request.sampling.pooling is not None:
                rows = len(inputs.token_ids)
                inputs.pooling.append(PoolSpan(request.request_id, request.sampling.pooling,
                                               rows - chunk.num_tokens, rows, start))
            if chunk.completes_sequence:
                rows = len(inputs.token_ids)
                inputs.sample_rows.extend(range(rows - 1 - len(chunk.draft_token_ids), rows))
                inputs.sampling_chunks.append(chunk)
        return inputs

    @property
    def is_decode_only(self) -> bool:
        return len(self.token_ids) == len(self.query_lens)

    @property
    def rows_are_decodes(self) -> bool:
        """Every row is a decode over its causal prefix: a request's one new token, or its
        last token and drafts (no prompt rows)."""
        return not self.has_prompt_rows

    def pack(self) -> torch.Tensor:
        """One int64 tensor, to broadcast to the other tensor-parallel ranks."""
        width = max((len(table) for tables in self.block_tables for table in tables), default=0)
        tables = [block for group in self.block_tables for table in group
                  for block in (*table, *[0] * (width - len(table)))]
        slots = [slot for group in self.slot_mappings for slot in group]
        header = [len(self.token_ids), len(self.query_lens), width, len(self.sample_rows),
                  len(self.block_tables), int(self.has_prompt_rows), len(self.drafted)]
        return torch.tensor([*header, *self.token_ids, *self.positions, *slots,
                             *self.query_lens, *self.seq_lens, *tables, *self.sample_rows,
                             *self.drafted], dtype=torch.int64)

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> StepInputs:
        """`pack`'s inverse (the sampling chunks stay with rank 0). A block table comes back
        padded with block 0, which attention never reads past the sequence's length."""
        values = packed.tolist()
        tokens, requests, width, samples, groups, has_prompt_rows, drafted = values[:7]
        cuts = itertools.accumulate([7, tokens, tokens, groups * tokens, requests, requests,
                                     groups * requests * width, samples, drafted])
        parts = [values[start:end] for start, end in itertools.pairwise(cuts)]
        token_ids, positions, slots, query_lens, seq_lens, tables, sample_rows, drafted_ids = parts
        rows = [tables[i * width:(i + 1) * width] for i in range(groups * requests)]
        return cls(token_ids, positions,
                   [slots[g * tokens:(g + 1) * tokens] for g in range(groups)],
                   query_lens, seq_lens,
                   [rows[g * requests:(g + 1) * requests] for g in range(groups)], sample_rows,
                   has_prompt_rows=bool(has_prompt_rows), drafted=drafted_ids)


class ModelRunner:
    """Runs steps over the paged KV cache. The cache holds one block more than the
    scheduler's: the null block standing behind sliding windows in block tables, which
    recorded decode graphs (engine.executor.cuda_graphs, with a graph `recorder`) also pad
    their batches with."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, compiled: bool = False,
                 recorder: Recorder | None = None, max_model_len: int = 0,
                 max_num_seqs: int = 0, tensor_parallel: bool = False,
                 layout: KVCacheLayout | None = None, batch_invariant: bool = False,
                 cache_dtype: torch.dtype | None = None, decode_tapes: bool = False,
                 max_drafts: int = 0) -> None:
        """`tensor_parallel`: this is rank 0 of several, and sends each step's inputs to the
        others before running it (engine.distributed.tensor_parallel). `layout`: the layers'
        KV cache groups (default: one). `batch_invariant`: see KernelChoice. `cache_dtype`:
        the KV cache's (default: `dtype`; 8-bit: engine.attention.quantized_kv).
        `decode_tapes`: small decode steps replay kernel tapes where they can
        (engine.executor.decode_tapes: the CPU's C++ attention, eager, one rank), one
        request's steps with up to `max_drafts` drafts (speculative decoding) among them."""
        self.model = model
        self.layout = layout or KVCacheLayout.single(model.num_layers)
        assign_kv_groups(model, self.layout)
        cache_dtype = cache_dtype or dtype
        self.kernels = KernelChoice.choose(model, device, dtype, block_size, compiled,
                                           batch_invariant, cache_dtype)
        self.kernels.bind(model)
        if not compiled:  # inductor traces the modules as nn.Module keeps them
            pin_attributes(model)
        self.attention = self.kernels.attention
        self.tensor_parallel = tensor_parallel
        self.block_size = block_size
        self.device = device
        self.workspace = Workspace()  # the step's logits: valid until the next step runs
        *shape, head_dim = model.kv_cache_shape(num_blocks + 1, block_size)
        shape = (*shape, row_width(head_dim, cache_dtype))
        # Zeroed, not empty: padded tails of blocks are read (and masked) by attention.
        skew = iter(skews(2 * self.layout.group_size))
        storage = [(zeros_on_huge_pages(shape, cache_dtype, device, next(skew)),
                    zeros_on_huge_pages(shape, cache_dtype, device, next(skew)))
                   for _ in range(self.layout.group_size)]
        # The pool hands out low block ids first: their pages are mapped now and then a
        # stretch ahead of the blocks steps write, not mid-step.
        caches = list(itertools.chain.from_iterable(storage))
        block_bytes = caches[0][0].numel() * caches[0].element_size()
        self.pages = PagesAhead(caches, num_blocks + 1,
                                stretch=PREFAULT_BYTES // (block_bytes * len(caches)))
        self.kv_caches = [storage[self.layout.place(layer)[1]]
                          for layer in range(model.num_layers)]
        if is_quantized(cache_dtype):
            self._calibrate_keys(num_blocks)
        self.forward: Forward = model
        if compiled:
            self.forward = compile_forward(model)
            timed_warm_up(self._placeholder_step)
        self.graphs: DecodeGraphs | None = None
        if recorder is not None:
            self.graphs = DecodeGraphs(self.forward, self.kv_caches, block_size, max_model_len,
                                       max_num_seqs, padding_block=num_blocks, device=device,
                                       recorder=recorder, num_groups=self.layout.num_groups)
        self.tapes: DecodeTapes | None = None
        c_plus_plus = getattr(self.attention, "uses_kernel", False)
        if (decode_tapes and c_plus_plus and device.type == "cpu" and recorder is None
                and not compiled and not tensor_parallel and not batch_invariant):
            self.tapes = DecodeTapes(model, self.forward, self.kv_caches, self.attention,
                                     block_size, max_model_len, self.layout.num_groups)
            self.tapes.record_decodes()
            self.tapes.record_drafted(max_drafts)

    @property
    def kv_meaning(self) -> str:
        """What the cache's rows mean beyond their shape and dtype: a digest of an 8-bit
        cache's key tables (engine.attention.key_smoothing), empty for a plain cache."""
        return fingerprint([layer.key_smoothing for layer in attention_layers(self.model)])

    @torch.inference_mode()
    def _calibrate_keys(self, num_blocks: int) -> None:
        """An 8-bit cache's key tables (engine.attention.key_smoothing), from the queries and
        keys of text the model samples itself (seeded), in blocks no request holds yet; each
        tensor-parallel rank runs it with rank 0 and samples the same tokens."""
        config = self.model.config
        length = min(CALIBRATION_LENGTH, config.max_exact_len, num_blocks * self.block_size)
        blocks_each = -(-length // self.block_size)
        count = min(CALIBRATION_SEQUENCES, num_blocks // blocks_each)
        tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(count)]
        generator = torch.Generator().manual_seed(CALIBRATION_SEED)
        first = config.bos_token_id if config.bos_token_id is not None \
            else int(torch.randint(config.vocab_size, (), generator=generator))
        tokens = [first] * count
        layers = attention_layers(self.model)
        for layer in layers:
            layer.key_smoothing, layer.statistics = None, KeyStatistics()
        for position in range(length):
            slots = [table[position // self.block_size] * self.block_size
                     + position % self.block_size for table in tables]
            metadata = self.attention.build_metadata([1] * count, [position + 1] * count,
                                                     tables, slots, self.device)
            with forward_context([metadata] * self.layout.num_groups, self.attention):
                hidden = self.model(int_tensor(tokens, self.device),
                                    int_tensor([position] * count, self.device), self.kv_caches)
            logits = self.model.compute_logits(hidden).cpu()
            tokens = torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0].tolist()
        for layer in layers:
            assert layer.statistics is not None
            layer.key_smoothing = layer.statistics.smoothing(shift=layer.softcap is None)
            layer.statistics = None

    @torch.inference_mode()
    def _placeholder_step(self, num_tokens: int) -> None:
        """`num_tokens` one-token decodes at position 0 of block 0 (free before any request):
        what a step of that many tokens compiles, writing nothing a request will read."""
        metadata = self.attention.build_metadata([1] * num_tokens, [1] * num_tokens,
                                                 [[0]] * num_tokens, [0] * num_tokens,
                                                 self.device)
        zeros = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        with forward_context([metadata] * self.layout.num_groups, self.attention):
            self.forward(zeros, zeros, self.kv_caches)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], float32_logits: bool = True,
                give_way: Callable[[], bool] | None = None,
                ) -> tuple[list[ScheduledChunk], torch.Tensor, list[PoolSpan]]:
        """Runs the step; returns the chunks that sample a token, their float32 logits
        (`float32_logits=False`: in the model's dtype where the model leaves them so), and
        the embedding requests' pooled rows. A step replayed from a kernel tape stops
        (StepGaveWay) where `give_way` says so between its kernels; one tensor-parallel rank
        alone never does."""
        inputs = StepInputs.gather(chunks, self.block_size, self.layout.num_groups)
        if self.tensor_parallel:
            broadcast_step(inputs.pack())
            give_way = None
        return inputs.sampling_chunks, self.run(inputs, float32_logits, give_way), \
            inputs.pooling

    @torch.inference_mode()
    def run(self, inputs: StepInputs, float32_logits: bool = True,
            give_way: Callable[[], bool] | None = None) -> torch.Tensor:
        """The step's forward; float32 logits of its sample rows (in the runner's buffer:
        read them before the next step)."""
        highest_slot = max((max(slots) for slots in inputs.slot_mappings if slots), default=-1)
        self.pages.follow(highest_slot // self.block_size)
        graphs = self.graphs
        if graphs is not None and inputs.is_decode_only and not inputs.pooling \
                and graphs.serves(len(inputs.token_ids),
                                  max(map(len, inputs.block_tables[0]), default=0)):
            hidden = graphs.run(inputs.token_ids, inputs.positions, inputs.slot_mappings,
                                inputs.seq_lens, inputs.block_tables)
            return self._logits(inputs, hidden, float32_logits)
        if self.tapes is not None and inputs.rows_are_decodes and not inputs.pooling:
            hidden = self._replayed(inputs, give_way)
            if hidden is not None:
                return self._logits(inputs, hidden, float32_logits)
        drafted = frozenset(inputs.drafted)
        metadata = [self.attention.build_metadata(inputs.query_lens, inputs.seq_lens, tables,
                                                  slots, self.device, row_requests=drafted)
                    for tables, slots in zip(inputs.block_tables, inputs.slot_mappings,
                                             strict=True)]
        # Prompt rows come out the same however much of their prompt was cached: a step that
        # computes some runs enough rows that the GEMMs keep one kernel (token 0 at position
        # 0 as padding, which attention leaves out: engine.layers.batch_invariant); the
        # batch-invariant mode pads every step.
        pad = self.kernels.padded_steps and (self.kernels.batch_invariant
                                              or inputs.has_prompt_rows)
        token_ids, positions = inputs.token_ids, inputs.positions
        extra = self.kernels.min_rows - len(token_ids) if pad else 0
        if extra > 0:
            token_ids, positions = token_ids + [0] * extra, positions + [0] * extra
        with forward_context(metadata, self.attention, pad_products=pad, give_way=give_way):
            hidden = self.forward(int_tensor(token_ids, self.device),
                                  int_tensor(positions, self.device), self.kv_caches)
            for span in inputs.pooling:
                pool_rows(span, hidden, self.model.model.norm)
            return self._logits(inputs, hidden[:len(inputs.token_ids)], float32_logits)

    @property
    def num_recordings(self) -> int:
        """Tapes recorded (or refused) so far: a step that recorded one took many times what
        its shape takes from then on."""
        return 0 if self.tapes is None else self.tapes.num_recorded

    def _replayed(self, inputs: StepInputs,
                  give_way: Callable[[], bool] | None) -> torch.Tensor | None:
        """The step's hidden states from a tape, or None where none serves it."""
        assert self.tapes is not None
        width = max((len(table) for tables in inputs.block_tables for table in tables),
                    default=0)
        if not self.tapes.serves(len(inputs.token_ids), len(inputs.query_lens), width):
            return None
        return self.tapes.run(inputs.token_ids, inputs.positions, inputs.query_lens,
                              inputs.slot_mappings, inputs.block_tables, give_way)

    def _logits(self, inputs: StepInputs, hidden: torch.Tensor,
                float32_logits: bool) -> torch.Tensor:
        if not inputs.sample_rows:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        if len(inputs.sample_rows) < hidden.shape[0]:
            hidden = hidden.index_select(0, int_tensor(inputs.sample_rows, self.device))
        return self.model.compute_logits(hidden, self.workspace, float32_logits)


def attention_layers(model: torch.nn.Module) -> list[PagedAttention]:
    return [module for module in model.modules() if isinstance(module, PagedAttention)]


def assign_kv_groups(model: torch.nn.Module, layout: KVCacheLayout) -> None:
    """Each attention layer (in layer order) reads its KV cache group's block tables."""
    layers = attention_layers(model)
    if len(layers) != model.num_layers:
        raise ValueError(f"{len(layers)} attention layers in a model of {model.num_layers}")
    for index, layer in enumerate(layers):
        layer.kv_group = layout.place(index)[0]
