"""The frontend's flags, defined once: `python launch.py` takes them and hands them on to
`python -m frontend`, which takes the same ones (vLLM's names where it has one)."""

from __future__ import annotations

import argparse
import os

from common.config import add_chat_args
from frontend.admission import DEFAULT_MAX_WAITING_REQUESTS
from frontend.body_limit import DEFAULT_MAX_BODY_BYTES
from frontend.connection_limits import (
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REQUEST_READ_TIMEOUT_S,
)
from frontend.disaggregation import parse_kv_roles
from frontend.router import ROUTING_POLICIES
from frontend.tenants import TenantsFileError, load_tenants

API_KEY_ENV = "LOOM_API_KEY"


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients use (default: the model's directory or "
                             "file name)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--shutdown-timeout", type=float, default=3.0,
                        help="seconds in-flight requests get to finish on SIGTERM/Ctrl-C")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help="require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize "
                             f"(default: ${API_KEY_ENV}; /health and /metrics stay open)")
    parser.add_argument("--max-waiting-requests", type=positive_int,
                        default=DEFAULT_MAX_WAITING_REQUESTS,
                        help="requests waiting for the engine (each of n choices counts) "
                             "beyond which new ones get 503 with Retry-After")
    parser.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body accepted; larger ones get 413")
    parser.add_argument("--request-read-timeout", type=positive_seconds,
                        default=DEFAULT_REQUEST_READ_TIMEOUT_S,
                        help="seconds a client gets to send a whole request (request line, "
                             "headers and body) from its first byte; later: 408, connection "
                             "closed")
    parser.add_argument("--keep-alive-timeout", type=positive_seconds,
                        default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
                        help="seconds an open connection may wait for its next request (or "
                             "its first) before it is closed")
    parser.add_argument("--max-connections", type=positive_int,
                        default=DEFAULT_MAX_CONNECTIONS,
                        help="open HTTP connections; beyond them a new one gets 503 and is "
                             "closed (lowered to what the descriptor limit allows)")
    parser.add_argument("--routing-policy", default="cache_aware", choices=ROUTING_POLICIES,
                        help="how a request picks one of several engines: prefix affinity "
                             "within a load bound (cache_aware), least loaded, round robin")
    parser.add_argument("--kv-roles", default=None, metavar="ROLE,ROLE,...",
                        help="prefill/decode disaggregation: each engine's role, in rank "
                             "order: prefill, decode or both (vLLM's kv_producer, kv_consumer, "
                             "kv_both). A request's prompt runs on a prefill engine, which "
                             "hands its KV to a decode engine that generates the rest")
    parser.add_argument("--pooling-type", default="last", choices=("last", "mean"),
                        type=str.lower,
                        help="how /v1/embeddings pools a prompt's final hidden states: the "
                             "last token's (vLLM's default for decoder models) or their mean")
    parser.add_argument("--tenants", default=None, metavar="FILE",
                        help="a TOML file of tenants: each one's key (as its sha256), weight "
                             "(its fair share of the engine) and limits (concurrent requests, "
                             "prompt and output tokens per minute); keys not in it get 401. "
                             "Exclusive with --api-key / $" + API_KEY_ENV + " (give every "
                             "caller a tenant instead)")
    parser.add_argument("--admission-control", action="store_true",
                        help="refuse at once (503 + Retry-After) a request whose "
                             "X-Request-Timeout deadline the queue cannot meet, as estimated "
                             "from the engines' measured prompt rate")
    add_chat_args(parser)


def check_kv_roles(parser: argparse.ArgumentParser, args: argparse.Namespace,
                   num_engines: int) -> None:
    """--kv-roles: one known role per engine; `args.kv_role_list` holds them (or None)."""
    args.kv_role_list = None
    if args.kv_roles is not None:
        try:
            args.kv_role_list = parse_kv_roles(args.kv_roles, num_engines)
        except ValueError as exc:
            parser.error(f"--kv-roles: {exc}")


def check_tenant_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--tenants: readable and valid now (a bad file fails at start, naming the field), and
    not combined with --api-key."""
    if args.tenants is None:
        args.tenant_table = None
        return
    if args.api_key:
        parser.error(f"--tenants and --api-key (or ${API_KEY_ENV}) are exclusive: give every "
                     f"caller a tenant, with its key's sha256, in the tenants file")
    try:
        args.tenant_table = load_tenants(args.tenants)
    except TenantsFileError as exc:
        parser.error(str(exc))
