"""How many HTTP connections the frontend holds and for how long, and the descriptor
limit that has to make room for them.

Defaults, against the anchors: nginx gives a request's headers and its body 60 s each
(client_header_timeout, client_body_timeout) and Node's http server 60 s for the headers;
here one deadline of 60 s covers the whole request from its first byte, since a client
that sends a byte every few seconds never stalls by nginx's between-two-reads measure.
An idle keep-alive connection is closed after 20 s: longer than the connection pools of
the usual clients keep one (httpx and so the OpenAI SDK 5 s, aiohttp 15 s), so the client
drops it first and never races a close with its next request (uvicorn, under vLLM, waits
5 s; nginx 75 s). The cap of 4,096 connections is room for every running and waiting
request of the default limits (256 + 1,024) three times over, idle keep-alive connections
included, while one frontend process still answers each of them promptly.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass

from frontend.raw_reply import LINGER_S

logger = logging.getLogger("loom.frontend")

DEFAULT_REQUEST_READ_TIMEOUT_S = 60.0
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 20.0
DEFAULT_MAX_CONNECTIONS = 4096
# Descriptors the process needs besides client connections: engine sockets, the
# tokenizer's files, logs, and refusals in their lingering close (connection_guard).
RESERVED_DESCRIPTORS = 512


@dataclass(slots=True)
class ConnectionLimits:
    max_connections: int
    keep_alive_timeout_s: float
    request_read_timeout_s: float
    linger_s: float = LINGER_S


def raise_descriptor_limit() -> int:
    """The soft RLIMIT_NOFILE raised to the hard limit (an operator who set a hard limit
    meant the server to use it); returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the descriptor limit from %d to %d: %s",
                           soft, hard, exc)
            return soft
        logger.info("descriptor limit raised from %d to its hard limit %d", soft, hard)
        return hard
    return soft


def connection_cap(requested: int, descriptor_limit: int) -> int:
    """`requested`, or fewer where the descriptor limit leaves no room for them."""
    room = max(descriptor_limit - RESERVED_DESCRIPTORS, 1)
    if requested > room:
        logger.warning("--max-connections %d lowered to %d: the descriptor limit is %d "
                       "(raise it with ulimit -n)", requested, room, descriptor_limit)
        return room
    return requested
