"""Random-weight models for the GPU check (bench/gpu_check.sh), where no weights can travel.

    python -m bench.gpu_models --tokenizer .whl/tokenizer --out /tmp/loom-gpu-models

Writes two Hugging Face directories (config.json, model.safetensors, the tokenizer files):
`smollm2-135m-random` with SmolLM2-135M-Instruct's own config, and `llama-1b-random`, a
Llama-3.2-1B-like shape (2048 hidden, 16 layers, 32 query / 8 KV heads of 128, 8192 MLP)
over the same 49,152-token vocabulary so the same tokenizer serves it. Weights are drawn on
the fastest device at hand (std 0.02, norms 1), in bfloat16.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json", "special_tokens_map.json")
LLAMA_1B_SHAPE = {
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": True,
}


def write_random_model(out: Path, config: dict, tokenizer_dir: Path, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    hf_config = LlamaConfig(**{key: value for key, value in config.items()
                               if key not in ("architectures", "transformers_version")})
    with torch.device(device):
        model = LlamaForCausalLM(hf_config).to(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_models")
    parser.add_argument("--tokenizer", type=Path, required=True,
                        help="a directory with SmolLM2's config.json and tokenizer files")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", choices=["smollm2", "llama-1b"], default=None)
    args = parser.parse_args()
    smollm2 = json.loads((args.tokenizer / "config.json").read_text())
    configs = {"smollm2": ("smollm2-135m-random", smollm2),
               "llama-1b": ("llama-1b-random", {**smollm2, **LLAMA_1B_SHAPE})}
    for key, (name, config) in configs.items():
        if args.only in (None, key):
            print(write_random_model(args.out / name, config, args.tokenizer), flush=True)


if __name__ == "__main__":
    main()
