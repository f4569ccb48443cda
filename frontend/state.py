"""What the request handlers share: settings, engine facts, engine client, tokenizer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web

from common.protocol import Ready
from frontend.engine_client import EngineClient
from frontend.errors import engine_unavailable, model_not_found
from frontend.tokenization import TokenizerService


@dataclass(slots=True)
class FrontendSettings:
    served_model_name: str
    requests_addr: str
    outputs_addr: str
    engine_info: Ready | None = None


@dataclass(slots=True)
class ServerState:
    settings: FrontendSettings
    tokenizer: TokenizerService
    engine: EngineClient | None = None  # created on startup, inside the event loop
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name

    def unavailable_reason(self) -> str | None:
        if self.settings.engine_info is None:
            return "The engine has not reported its configuration."
        if self.engine is None or self.engine.engine_dead:
            return "The engine is not running."
        return None

    def ready_engine(self) -> tuple[EngineClient, Ready]:
        """The engine client and its facts, or a 503 when there is no working engine."""
        reason = self.unavailable_reason()
        if reason is not None:
            raise engine_unavailable(reason)
        assert self.engine is not None and self.settings.engine_info is not None
        return self.engine, self.settings.engine_info

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise model_not_found(model)


STATE = web.AppKey("loom_state", ServerState)
