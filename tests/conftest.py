"""Fixtures shared by the frontend test modules: the offline test tokenizer and a running
frontend app served against the scripted fake engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
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
