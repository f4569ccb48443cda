"""Which implementation each op of the model runs, chosen once at start-up from device,
dtype, CPU flags and whether the forward is compiled, bound into the model's layers and
logged in one line.

- attention: one backend for the whole run (engine.attention.selector), which also builds
  every step's metadata before the forward;
- elementwise ops (norms, rotary, SiLU·mul): our C++ kernels eager on a CPU where they build,
  torch ops elsewhere and under torch.compile (which fuses them itself);
- linears: packed or quantized ones as loaded (engine.quantization); compiled, each such
  layer, each routed-experts block (its grouping is data-dependent) and each attention layer
  runs as one opaque op, so the graph stays whole around them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.attention.selector import select_attention_backend
from engine.kernels.build import kernel_enabled
from engine.kernels.elementwise import load_elementwise
from engine.layers.attention import PagedAttention
from engine.layers.batch_invariant import min_rows, use_code_kernels, use_dense_copies
from engine.layers.custom_op import Implementation, use_implementation
from engine.layers.moe import FusedMoE, Router
from engine.layers.opaque_linear import trace_as_op
from engine.quantization.base import QuantizedLinear
from engine.quantization.unquantized import PackedLinear


@dataclass(frozen=True, slots=True)
class KernelChoice:
    attention: AttentionBackend
    elementwise: Implementation
    compiled: bool
    batch_invariant: bool = False
    # Steps that ask for it run at least `min_rows` rows (engine.layers.batch_invariant):
    # CPU, eager
    padded_steps: bool = False
    min_rows: int = 0
    # Batch-invariant with every product on a code kernel (`code_kernels_only`): no padding.
    code_kernels: bool = False

    @classmethod
    def choose(cls, model: nn.Module, device: torch.device, dtype: torch.dtype,
               block_size: int, compiled: bool, batch_invariant: bool = False,
               cache_dtype: torch.dtype | None = None) -> KernelChoice:
        """`batch_invariant`: the kernels that give a row the same bits whatever shares its
        step (engine.layers.batch_invariant); a ValueError where that cannot be.
        `cache_dtype`: the KV cache's (default: `dtype`)."""
        backend = select_attention_backend(device, dtype, model.num_local_heads,
                                           model.num_local_kv_heads, model.config.head_dim,
                                           block_size, batch_invariant, cache_dtype)
        cpp = (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
               and not compiled and kernel_enabled("LOOM_CPP_ELEMENTWISE")
               and load_elementwise() is not None)
        code_kernels = batch_invariant and code_kernels_only(model)
        padded = device.type == "cpu" and not compiled and not code_kernels
        return cls(backend, "cpu" if cpp else "native", compiled, batch_invariant, padded,
                   min_rows(dtype), code_kernels)

    def bind(self, model: nn.Module) -> None:
        """Every layer of the model runs its chosen implementation from now on."""
        use_implementation(model, self.elementwise)
        if self.code_kernels:
            use_code_kernels(model)
        elif self.batch_invariant:
            use_dense_copies(model)
        if not self.compiled:
            return
        inside_ops = {id(module.dense) for module in model.modules()
                      if isinstance(module, QuantizedLinear)}
        inside_ops |= {id(expert) for module in model.modules() if isinstance(module, FusedMoE)
                       for expert in module.modules() if expert is not module}
        for module in model.modules():
            if isinstance(module, (PackedLinear, QuantizedLinear, FusedMoE)) \
                    and id(module) not in inside_ops:
                trace_as_op(module)
            elif isinstance(module, PagedAttention):
                module.trace_as_op()

    def describe(self) -> str:
        elementwise = "C++" if self.elementwise == "cpu" else "torch ops"
        mode = "compiled (inductor)" if self.compiled else "eager"
        if self.code_kernels:
            mode += ", batch-invariant (every row a decode row, every product on the codes)"
        elif self.batch_invariant:
            mode += (f", batch-invariant (every row a decode row, products of >= "
                     f"{self.min_rows} rows)")
        return (f"kernels: attention {self.attention.name}, elementwise {elementwise}, "
                f"forward {mode}")


def code_kernels_only(model: nn.Module) -> bool:
    """Whether every weight the model multiplies is held as codes that a kernel of ours reads
    (`serves_float32`: int4 and Q8_0), which sums each output in one order whatever shares the
    call: then no step needs padding or a dense copy for a row to keep its bits."""
    quantized = [module for module in model.modules() if isinstance(module, QuantizedLinear)]
    copies = {id(layer.dense) for layer in quantized if layer.dense is not None}
    floats = [module for module in model.modules()
              if isinstance(module, (nn.Linear, PackedLinear, FusedMoE, Router))
              and id(module) not in copies]
    return bool(quantized) and not floats and all(layer.serves_float32 for layer in quantized)
