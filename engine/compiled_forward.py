"""The compiled forward: torch.compile (inductor) of the same model, same weights.

- Attention stays one opaque op (`loom::paged_attention`, see engine.attention.attend) that
  reads the step's metadata from the forward context, so each step is one whole graph.
- While tracing, engine.fused_ops hands inductor plain torch ops, which it fuses itself.
- Freezing: weights become constants and inductor prepacks the linears it finds.
- The token count varies per step: a lone decode (one token) gets a static graph, every other
  count one dynamic graph; `warm_up` compiles both before the engine says READY.
- Inductor's caches live under $LOOM_CACHE/inductor. In torch 2.13 a graph whose frozen
  weights inductor has prepacked for oneDNN bypasses the FX graph cache ("mkldnn tensors
  unpickleable"), so every start recompiles (about 20 s per graph on 2 cores); without the
  prepacking the GEMMs lose what makes compiling worth it. Hence compiling is opt-in
  (`--compile`): the eager path prepacks the same way and starts in seconds.
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
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default_cache_dir() / "inductor"))
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config

    inductor_config.freezing = True
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
