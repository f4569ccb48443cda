"""The compiled forward: torch.compile (inductor) of the same model, same weights.

- Attention stays one opaque op (`loom::paged_attention`, engine.attention.op) that reads
  the step's metadata and backend from the forward context, so each step is one whole graph.
- Packed and quantized linears stay the eager path's layers, each called as one opaque op
  (`loom::linear`, engine.layers.opaque_linear); inductor fuses what lies between them. The
  elementwise layers run their torch ops, which it fuses itself (engine.executor.kernel_choice
  binds all of that once, before compiling).
- No freezing: the graph holds no weights, so inductor's FX graph cache (under
  $LOOM_CACHE/inductor) stores it and a warm start loads it instead of recompiling. (Frozen
  weights that inductor prepacks for oneDNN bypass that cache: "mkldnn tensors unpickleable".)
- The token count varies per step: a lone decode (one token) gets a static graph, every other
  count one dynamic graph; `warm_up` compiles both before the engine says READY.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from common.default_model import default_cache_dir

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]],
                   torch.Tensor]


def configure_inductor() -> None:
    """Inductor's caches go under $LOOM_CACHE unless TORCHINDUCTOR_CACHE_DIR says otherwise
    (torch writes its own default into that variable the first time it reads it). Inductor
    is imported here, not at the top: it costs an eager engine's start ~1.3 s."""
    from torch._inductor.runtime.cache_dir_utils import (
        default_cache_dir as torch_default_cache_dir,
    )

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, torch_default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(default_cache_dir() / "inductor")
    import torch.fx.experimental._config as fx_config

    # A batch of 64 tokens must not be unified with head_dim 64 (a recompile per batch size).
    fx_config.use_duck_shape = False


def compile_forward(model: torch.nn.Module) -> Forward:
    """A server compiles one model; a process that builds several (tests, benchmarks) starts
    each from empty dynamo caches, or the same forward code would hit its recompile limit."""
    configure_inductor()
    torch._dynamo.reset()
    return torch.compile(model, fullgraph=True)


def timed_warm_up(run_step: Callable[[int], None], token_counts: tuple[int, ...] = (1, 2),
                  ) -> None:
    """Runs one step per token count (each compiles its graph) and logs how long it took."""
    started = time.perf_counter()
    for count in token_counts:
        run_step(count)
    logger.info("compiled the forward for %s tokens in %.1f s", token_counts,
                time.perf_counter() - started)
