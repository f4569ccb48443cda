"""Fixtures shared by the frontend test modules: the offline test tokenizer and a running
frontend app served against the scripted fake engine.

Also, before any test module can import triton (torch may, too): Triton's interpreter for
tests/test_triton_attention.py. Triton fixes which of its own library functions are
interpreted when it is first imported, so this must come first; LOOM_TRITON_NATIVE=1 (the
GPU check) compiles the kernels for CUDA instead."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET",
                      "0" if os.environ.get("LOOM_TRITON_NATIVE") == "1" else "1")

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tests.fake_engine import FrontendHarness, build_test_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_test_tokenizer()


@pytest.fixture
async def harness(tokenizer: Any) -> AsyncIterator[FrontendHarness]:
    async with FrontendHarness(tokenizer) as running:
        yield running



def shared_server(tmp_path_factory, flags: list[str]) -> Iterator[Any]:
    """launch.py on the default model with `flags`, for a session-scoped fixture: started on
    first use, stopped (cleanly) at the session's end."""
    from tests.launched_server import LaunchedServer

    launched = LaunchedServer(flags).start(tmp_path_factory.mktemp("logs"))
    yield launched
    assert launched.stop() == 0, launched.log


@pytest.fixture(scope="session")
def keyed_default_server(tmp_path_factory):
    """launch.py on the default model with an API key, shared by the Messages and Responses
    e2e modules (one start instead of two)."""
    from tests.agent_apis import API_KEY

    yield from shared_server(tmp_path_factory, ["--api-key", API_KEY])


@pytest.fixture(scope="session")
def default_server(tmp_path_factory):
    """launch.py on the default model with no flags at all, shared by the e2e modules that
    test the defaults (test_tools_e2e, test_batch_invariant_e2e: one start instead of two)."""
    yield from shared_server(tmp_path_factory, [])


@pytest.fixture(scope="session")
def float32_default_server(tmp_path_factory):
    """launch.py on the default model in fp32, shared by the e2e modules that need nothing
    else (test_e2e, test_openai_e2e, test_utf8_e2e, and tensor parallelism's one-rank answer:
    one start instead of four)."""
    yield from shared_server(tmp_path_factory, ["--dtype", "float32"])
