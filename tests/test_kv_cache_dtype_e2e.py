"""`launch.py --kv-cache-dtype int8` on the default model, as a user starts it: the start-up
line names the cache's format and blocks per GiB, streams run side by side, and a greedy
answer is what transformers computes with its keys and values stored as the cache stores
them (fp32)."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from common.default_model import resolve_model
from engine.attention.key_smoothing import (
    CALIBRATION_LENGTH,
    CALIBRATION_SEQUENCES,
    KeySmoothing,
)
from engine.executor.model_runner import ModelRunner, attention_layers
from engine.weights.loader import load_model
from tests.launched_server import LaunchedServer
from tests.test_quantized_kv_engine import oracle_attention

pytestmark = pytest.mark.e2e

QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "Write one sentence about the ocean.", "2+2="]
MAX_TOKENS = 12


def served_key_tables(directory: str) -> list[KeySmoothing]:
    """The tables the server's engine made: a runner on the same weights calibrates the
    same way (its cache holds the calibration's texts, as the server's does)."""
    model = load_model(directory, torch.float32, torch.device("cpu"))
    blocks = CALIBRATION_SEQUENCES * CALIBRATION_LENGTH // 16
    ModelRunner(model, blocks, 16, torch.device("cpu"), torch.float32,
                cache_dtype=torch.int8)
    return [layer.key_smoothing for layer in attention_layers(model)]


def oracle_text(prompt: list[int]) -> str:
    directory = resolve_model(None)
    AttentionInterface.register("loom_int8_kv_e2e",
                                oracle_attention(torch.int8, served_key_tables(directory)))
    AttentionMaskInterface.register("loom_int8_kv_e2e", sdpa_mask)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                 attn_implementation="loom_int8_kv_e2e")
    with torch.no_grad():
        output = model.eval().generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
            max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return AutoTokenizer.from_pretrained(directory).decode(output[0, len(prompt):])


async def streamed_chat(session: aiohttp.ClientSession, url: str, model: str,
                        question: str, **extra: object) -> str:
    """A greedy streamed chat answer of MAX_TOKENS tokens (or fewer), its deltas joined."""
    body = {"model": model, "messages": [{"role": "user", "content": question}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, **extra}
    text = ""
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            data = line.decode().removeprefix("data: ").strip()
            if data and data != "[DONE]":
                text += json.loads(data)["choices"][0]["delta"].get("content") or ""
    return text


async def test_an_int8_kv_cache_serves_what_transformers_computes_on_its_codes(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    server = LaunchedServer(["--dtype", "float32", "--kv-cache-dtype", "int8"])
    with server.start(tmp_path_factory.mktemp("logs")):
        line = re.search(r"KV cache: .*", server.log).group(0)
        assert "blocks per GiB" in line and "int8 codes + fp32 scale per token and head" in line
        assert "3.76x the tokens of float32" in line  # head_dim 64: 256 bytes -> 68
        async with aiohttp.ClientSession() as session:
            url = server.base_url
            model = (await (await session.get(f"{url}/v1/models")).json())["data"][0]["id"]
            answers = await asyncio.gather(*(streamed_chat(session, url, model, question)
                                             for question in QUESTIONS))
            assert all(answers), answers
            prompt = AutoTokenizer.from_pretrained(resolve_model(None)).encode(
                "The three laws of motion are")
            body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True}
            async with session.post(f"{url}/v1/completions", json=body) as response:
                reply = await response.json()
            assert response.status == 200, reply
    assert reply["choices"][0]["text"] == oracle_text(prompt)
