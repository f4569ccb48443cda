"""The frontend's flags, defined once: `python launch.py` takes them and hands them on to
`python -m frontend`, which takes the same ones (vLLM's names where it has one)."""

from __future__ import annotations

import argparse
import os

from common.config import add_chat_args
from frontend.admission import DEFAULT_MAX_WAITING_REQUESTS
from frontend.body_limit import DEFAULT_MAX_BODY_BYTES
from frontend.router import ROUTING_POLICIES

API_KEY_ENV = "LOOM_API_KEY"


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
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
    parser.add_argument("--routing-policy", default="cache_aware", choices=ROUTING_POLICIES,
                        help="how a request picks one of several engines: prefix affinity "
                             "within a load bound (cache_aware), least loaded, round robin")
    parser.add_argument("--pooling-type", default="last", choices=("last", "mean"),
                        type=str.lower,
                        help="how /v1/embeddings pools a prompt's final hidden states: the "
                             "last token's (vLLM's default for decoder models) or their mean")
    add_chat_args(parser)
