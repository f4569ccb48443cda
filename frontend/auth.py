"""API keys: every /v1 route and the tokenizer routes need `Authorization: Bearer <key>`
(or Anthropic's `x-api-key: <key>`) when a key is set.

/health and /metrics stay open, as load balancers and scrapers expect.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from frontend.errors import unauthorized

PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize")


def is_protected(path: str) -> bool:
    return any(path == prefix or path.startswith(prefix + "/") for prefix in PROTECTED_PREFIXES)


def bearer_token(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def api_key_middleware(api_key: str) -> web.middleware:
    expected = api_key.encode()

    @web.middleware
    async def check_api_key(request: web.Request, handler) -> web.StreamResponse:
        if is_protected(request.path):
            token = bearer_token(request) or request.headers.get("x-api-key", "").strip()
            if not token:
                raise unauthorized("Missing API key: send it as an 'Authorization: Bearer "
                                   "<key>' header (or 'x-api-key: <key>').")
            if not hmac.compare_digest(token.encode(), expected):
                raise unauthorized("Incorrect API key provided.")
        return await handler(request)

    return check_api_key
