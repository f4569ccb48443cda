"""`launch.py --quantization w4a8` on the default model, as a user starts it: the start-up line
names the layers' format, streams run side by side, and each greedy answer is what the engine
computes in process with the same method (whose layers answer to float math on the
fake-quantized activations: tests/test_quantization.py)."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest
from transformers import AutoTokenizer

from common.default_model import resolve_model
from tests.engine_helpers import greedy_request, make_core, run_to_completion
from tests.launched_server import LaunchedServer
from tests.test_kv_cache_dtype_e2e import MAX_TOKENS, streamed_chat

pytestmark = pytest.mark.e2e

# The first one's greedy answer with fp32 activations (`auto`) differs from its first token.
QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "Write one sentence about the ocean."]

def in_process_answers(quantization: str) -> list[str]:
    directory = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    core = make_core(directory, quantization=quantization)
    requests = [greedy_request(tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False),
        MAX_TOKENS) for question in QUESTIONS]
    outputs = run_to_completion(core, requests)
    return [tokenizer.decode(outputs[request.request_id]) for request in requests]


async def test_w4a8_serves_what_the_engine_computes_with_8_bit_activations(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    server = LaunchedServer(["--dtype", "float32", "--quantization", "w4a8"])
    with server.start(tmp_path_factory.mktemp("logs")):
        assert re.search(r"120 w4a8 \+ 1 q8_0 linears \(groups of 32\)", server.log)
        async with aiohttp.ClientSession() as session:
            url = server.base_url
            model = (await (await session.get(f"{url}/v1/models")).json())["data"][0]["id"]
            answers = await asyncio.gather(*(streamed_chat(session, url, model, question,
                                                           ignore_eos=True)
                                             for question in QUESTIONS))
    expected = in_process_answers("w4a8")
    assert answers == expected
    assert in_process_answers("auto")[0] != expected[0]  # the check tells the two apart
