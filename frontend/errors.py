"""OpenAI-style API errors: one exception type, rendered as `{"error": {...}}` bodies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "NotFoundError"
SERVER_ERROR = "server_error"
SERVICE_UNAVAILABLE = "service_unavailable"


@dataclass
class APIError(Exception):
    message: str
    status: int = 400
    type: str = INVALID_REQUEST
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        Exception.__init__(self, self.message)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)

    def anthropic_body(self) -> dict[str, Any]:
        kind = ANTHROPIC_ERROR_TYPES.get(self.status, "api_error" if self.status >= 500
                                         else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def anthropic_response(self) -> web.Response:
        return web.json_response(self.anthropic_body(), status=self.status,
                                 headers=self.headers)


# Anthropic's error types by HTTP status (its API's "Errors" page).
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                         503: "overloaded_error", 529: "overloaded_error"}


def invalid_param(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(message, status=400, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(
        f"The model `{model}` does not exist.",
        status=404,
        type=INVALID_REQUEST,
        param="model",
        code="model_not_found",
    )


def engine_unavailable(reason: str) -> APIError:
    return APIError(reason, status=503, type=SERVICE_UNAVAILABLE, code="engine_unavailable")


def overloaded(reason: str, retry_after_s: int) -> APIError:
    return APIError(
        reason,
        status=503,
        type=SERVICE_UNAVAILABLE,
        code="server_overloaded",
        headers={"Retry-After": str(retry_after_s)},
    )


def shutting_down() -> APIError:
    return APIError(
        "The server is shutting down.", status=503, type=SERVICE_UNAVAILABLE, code="shutting_down"
    )


def unauthorized(message: str) -> APIError:
    return APIError(
        message, status=401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
    )


def body_too_large(limit: int, size: int | None) -> APIError:
    actual = "" if size is None else f" (got {size} bytes)"
    return APIError(
        f"The request body exceeds the limit of {limit} bytes{actual}.",
        status=413,
        code="request_too_large",
    )


def internal_error(reason: str) -> APIError:
    return APIError(reason, status=500, type=SERVER_ERROR, code="internal_error")


def request_timeout(part: str, timeout_s: float) -> APIError:
    """`part`: what had not arrived ("headers", "body")."""
    return APIError(
        f"The request's {part} did not arrive within {timeout_s:g} s of its first byte "
        "(--request-read-timeout); the connection is closed.",
        status=408,
        code="request_timeout",
    )


def too_many_connections(limit: int) -> APIError:
    return APIError(
        f"The server holds its maximum of {limit} open connections (--max-connections); "
        "try again shortly.",
        status=503,
        type=SERVICE_UNAVAILABLE,
        code="too_many_connections",
        headers={"Retry-After": "1"},
    )
