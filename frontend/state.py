"""What the request handlers share: settings, engine facts, engine client, tokenizer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web

from common.protocol import Ready
from frontend.admission import DEFAULT_MAX_WAITING_REQUESTS, Admission
from frontend.body_limit import DEFAULT_MAX_BODY_BYTES
from frontend.connection_limits import (
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REQUEST_READ_TIMEOUT_S,
)
from frontend.deadline_admission import QueueEstimate
from frontend.drain import Drain
from frontend.engine_pool import EnginePool
from frontend.errors import engine_unavailable, model_not_found
from frontend.metrics import LoomMetrics
from frontend.tenant_gate import TenantGate
from frontend.tenants import TenantTable
from frontend.tokenization import TokenizerService


@dataclass(frozen=True, slots=True)
class EngineAddress:
    requests: str  # ZeroMQ address of the engine's request socket (we connect)
    outputs: str  # ... of its output socket
    pid: int | None = None  # watched, so the engine's death is noticed at once


@dataclass(slots=True)
class FrontendSettings:
    served_model_name: str
    engines: list[EngineAddress]  # one per data-parallel rank, in rank order
    engine_info: Ready | None = None
    api_key: str | None = None  # None: the /v1 and tokenizer routes are open
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    tool_call_parser: str = "hermes"  # how tool calls are read out of replies
    routing_policy: str = "cache_aware"  # frontend.router, with several engines
    kv_roles: list[str] | None = None  # each engine's, for prefill/decode disaggregation
    pooling_type: str = "last"  # how /v1/embeddings pools a prompt's states (engine.pooling)
    tenants: TenantTable | None = None  # --tenants: keys, weights and limits (frontend.tenants)
    admission_control: bool = False  # refuse requests whose deadline the queue cannot meet
    request_read_timeout_s: float = DEFAULT_REQUEST_READ_TIMEOUT_S
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS


@dataclass(slots=True)
class ServerState:
    settings: FrontendSettings
    tokenizer: TokenizerService
    engine: EnginePool | None = None  # created on startup, inside the event loop
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: LoomMetrics = field(default_factory=LoomMetrics)
    drain: Drain = field(default_factory=Drain)
    tenant_gate: TenantGate | None = None  # set with --tenants
    queue_estimate: QueueEstimate = field(default_factory=QueueEstimate)

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name

    @property
    def admission(self) -> Admission:
        return Admission(self.settings.max_waiting_requests)

    @property
    def engine_info(self) -> Ready | None:
        """What the engines serve: from launch.py, else from the first remote engine's
        READY (a frontend whose engines all run on other hosts)."""
        if self.settings.engine_info is None and self.engine is not None:
            self.settings.engine_info = self.engine.reported_info()
        return self.settings.engine_info

    def unavailable_reason(self) -> str | None:
        if self.engine_info is None:
            return "The engine has not reported its configuration."
        if self.engine is None or self.engine.engine_dead:
            return ("The engine is not running." if len(self.settings.engines) == 1
                    else "No engine is running.")
        return None

    def health_problem(self) -> str | None:
        if self.drain.draining:
            return "The server is shutting down."
        return self.unavailable_reason()

    def ready_engine(self) -> tuple[EnginePool, Ready]:
        """The engines and their facts, or a 503 when no engine works.

        A request that arrived before a drain began still runs: the drain refuses only
        new ones."""
        reason = self.unavailable_reason()
        if reason is not None:
            raise engine_unavailable(reason)
        assert self.engine is not None and self.settings.engine_info is not None
        return self.engine, self.settings.engine_info

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise model_not_found(model)


STATE = web.AppKey("loom_state", ServerState)
