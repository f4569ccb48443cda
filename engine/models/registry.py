"""The architectures Loom serves, by the `model_type` of a Hugging Face config.json."""

from __future__ import annotations

from torch import nn

from engine.models.gemma2 import Gemma2ForCausalLM
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
    "phi3": Phi3ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "gemma2": Gemma2ForCausalLM,
}


def model_class(model_type: str) -> type[nn.Module]:
    """The class serving `model_type`; one clear error naming it and the supported ones."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"architecture {model_type!r} is not supported; Loom serves "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[model_type]
