"""The aiohttp application: routes, error middleware, engine client lifecycle."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from common.curve import CurveKeys, load_secret
from common.sockets import is_tcp
from frontend.anthropic_api import count_tokens, create_message
from frontend.auth import api_key_middleware
from frontend.body_limit import body_limit_middleware
from frontend.connection_guard import ConnectionGuard, guard_middleware
from frontend.connection_limits import ConnectionLimits
from frontend.embeddings_api import create_embedding
from frontend.engine_client import EngineClient
from frontend.engine_pool import EnginePool
from frontend.engine_sentinel import watch_engine
from frontend.errors import INVALID_REQUEST, APIError, internal_error
from frontend.openai_api import create_chat_completion, create_completion
from frontend.read_timeout import read_timeout_middleware
from frontend.request_policy import request_policy_middleware
from frontend.response_store import ResponseStore
from frontend.responses_api import STORE, create_response, delete_response, get_response
from frontend.router import Router
from frontend.state import STATE, FrontendSettings, ServerState
from frontend.tenant_gate import TenantGate
from frontend.tokenization import TokenizerService
from frontend.tokenize_api import detokenize, tokenize

logger = logging.getLogger("loom.frontend")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ENGINE_SENTINELS = web.AppKey("loom_engine_sentinels", list)
GUARD = web.AppKey("loom_connection_guard", ConnectionGuard)


def create_app(settings: FrontendSettings, tokenizer: Any) -> web.Application:
    state = ServerState(settings=settings, tokenizer=TokenizerService(tokenizer))
    state.metrics.step_listeners.append(state.queue_estimate.observe_step)
    if settings.tenants is not None:
        state.tenant_gate = TenantGate.create(settings.tenants, state.metrics.registry)
    middlewares = [guard_middleware, error_middleware]
    if settings.api_key:
        middlewares.append(api_key_middleware(settings.api_key))
    middlewares.append(request_policy_middleware(state.tenant_gate))
    middlewares += [state.drain.middleware(), body_limit_middleware(settings.max_body_bytes),
                    read_timeout_middleware(settings.request_read_timeout_s)]
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_body_bytes)
    app[STATE] = state
    app[GUARD] = ConnectionGuard(ConnectionLimits(
        settings.max_connections, settings.keep_alive_timeout_s,
        settings.request_read_timeout_s), state.metrics)
    app[STORE] = ResponseStore()
    app.on_startup.append(_connect_engine)
    app.on_cleanup.append(_disconnect_engine)
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_post("/v1/embeddings", create_embedding)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def _connect_engine(app: web.Application) -> None:
    state = app[STATE]
    settings = state.settings
    several = len(settings.engines) > 1
    remote = any(is_tcp(address.requests) for address in settings.engines)
    curve = CurveKeys.derive(load_secret(None)) if remote else None  # from the environment
    clients = [EngineClient(address.requests, address.outputs, state.metrics, rank=rank,
                            restartable=several, curve=curve, expected=settings.engine_info)
               for rank, address in enumerate(settings.engines)]
    block_size = settings.engine_info.block_size if settings.engine_info else 16
    state.engine = EnginePool(clients, Router(settings.routing_policy, block_size),
                              state.metrics, settings.kv_roles)
    state.engine.start()
    app[ENGINE_SENTINELS] = [
        asyncio.create_task(watch_engine(address.pid, client.engine_exited_with),
                            name=f"engine-sentinel-{rank}")
        for rank, (address, client) in enumerate(zip(settings.engines, clients, strict=True))
        if address.pid is not None
    ]
    for rank, address in enumerate(settings.engines):
        logger.info("connected to engine %d at %s / %s", rank, address.requests,
                    address.outputs)


async def _disconnect_engine(app: web.Application) -> None:
    state = app[STATE]
    sentinels = app.get(ENGINE_SENTINELS, [])
    for sentinel in sentinels:
        sentinel.cancel()
    await asyncio.gather(*sentinels, return_exceptions=True)
    if state.engine is not None:
        await state.engine.close()
        state.engine = None
    state.tokenizer.close()


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model: dict[str, Any] = {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "loom",
    }
    info = state.engine_info
    if info is not None:
        model["root"] = info.model_name
        model["max_model_len"] = info.max_model_len
    return web.json_response({"object": "list", "data": [model]})


async def health(request: web.Request) -> web.Response:
    reason = request.app[STATE].health_problem()
    if reason is not None:
        return web.json_response({"status": "unavailable", "reason": reason}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine is not None:
        state.engine.refresh_metrics()
    body = state.metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Errors as OpenAI's bodies, or as Anthropic's on the Messages routes."""
    try:
        return await handler(request)
    except APIError as exc:
        return _error_response(request, exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error_type = INVALID_REQUEST if exc.status < 500 else "server_error"
        message = exc.text if exc.text and exc.text != exc.reason else exc.reason
        return _error_response(request, APIError(message, status=exc.status, type=error_type))
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return _error_response(request, internal_error("Internal server error."))


def _error_response(request: web.Request, error: APIError) -> web.Response:
    if request.path == "/v1/messages" or request.path.startswith("/v1/messages/"):
        return error.anthropic_response()
    return error.response()
