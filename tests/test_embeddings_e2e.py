"""/v1/embeddings through the official `openai` SDK against launch.py serving a tiny
random-weight Llama in fp32: each vector equals transformers' own final hidden states on
the same weights, pooled as the server was told (cosine >= 0.9999), in floats and base64,
from text and from token ids."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import numpy as np
import openai
import pytest

from tests.engine_helpers import reference_embedding
from tests.launched_server import LaunchedServer
from tests.tiny_server import TINY_MODEL_NAME, shared_tiny_model, tiny_server

pytestmark = pytest.mark.e2e
TEXTS = ["The loom weaves threads into cloth.", "Hello", "A third, somewhat longer input "
         "that spans more tokens than the others do."]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[LaunchedServer, str, str]]:
    """Mean pooling, named as vLLM's pooler config names it: the flag reaches the engine
    (the default, the last token's state, is the engine tests' too)."""
    model_dir = shared_tiny_model(tmp_path_factory)
    server = tiny_server(model_dir, "--pooling-type", "MEAN")
    server.start(tmp_path_factory.mktemp("logs"))
    yield server, model_dir, "mean"
    assert server.stop() == 0, server.log


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0].base_url + "/v1", api_key="unused", max_retries=0)


def token_ids(server: LaunchedServer, text: str) -> list[int]:
    request = urllib.request.Request(f"{server.base_url}/tokenize",
                                     json.dumps({"prompt": text}).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["tokens"]


def test_vectors_equal_transformers_hidden_states(served, client: openai.OpenAI) -> None:
    server, model_dir, kind = served
    result = client.embeddings.create(model=TINY_MODEL_NAME, input=TEXTS)  # base64 on the wire
    assert [item.index for item in result.data] == [0, 1, 2]
    ids = [token_ids(server, text) for text in TEXTS]
    assert result.usage.prompt_tokens == sum(map(len, ids))
    for item, prompt in zip(result.data, ids, strict=True):
        vector = np.array(item.embedding)
        assert float(np.dot(vector, reference_embedding(model_dir, prompt, kind))) >= 0.9999
    floats = client.embeddings.create(model=TINY_MODEL_NAME, input=TEXTS,
                                      encoding_format="float")
    from_ids = client.embeddings.create(model=TINY_MODEL_NAME, input=ids)
    for a, b, c in zip(result.data, floats.data, from_ids.data, strict=True):
        assert a.embedding == b.embedding == c.embedding


def test_dimensions_are_refused_and_the_server_serves_on(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=TINY_MODEL_NAME, input="Hi", dimensions=8)
    assert caught.value.body["param"] == "dimensions"
    assert len(client.embeddings.create(model=TINY_MODEL_NAME, input="Hi").data) == 1
