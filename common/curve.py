"""Authenticated, encrypted ZeroMQ links to engines on other hosts (CURVE).

Every link over tcp is a CurveZMQ session: the frontend's side is the CURVE server, each
engine a client, and a ZAP handler on the frontend admits only clients whose public key
comes from the shared secret. Both key pairs are derived from that one secret (read from a
file or the LOOM_DP_SECRET environment variable, never from a command line, which every
local user can read), so an operator distributes one secret and no key files.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

SECRET_ENV = "LOOM_DP_SECRET"
MIN_SECRET_BYTES = 16
# Socket-monitor events of a CURVE handshake that failed (a peer without the secret).
HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                      | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class SecretMissing(ValueError):
    """A tcp link was asked for without a usable shared secret."""


def load_secret(path: str | None) -> bytes:
    """The shared secret: the file's contents (stripped), else $LOOM_DP_SECRET."""
    if path is not None:
        secret = Path(path).read_bytes().strip()
        source = path
    else:
        secret = os.environ.get(SECRET_ENV, "").encode()
        source = f"${SECRET_ENV}"
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretMissing(f"engines on other hosts need a shared secret of at least "
                            f"{MIN_SECRET_BYTES} bytes (--data-parallel-secret-file or "
                            f"${SECRET_ENV}); {source} has {len(secret)}")
    return secret


@dataclass(frozen=True, slots=True)
class CurveKeys:
    server_public: bytes  # z85, 40 characters each
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def derive(cls, secret: bytes) -> CurveKeys:
        server_secret = _derived_key(secret, b"loom-frontend")
        client_secret = _derived_key(secret, b"loom-engine")
        return cls(zmq.curve_public(server_secret), server_secret,
                   zmq.curve_public(client_secret), client_secret)

    def secure_server(self, socket: zmq.Socket) -> None:
        """The frontend's end of a link: CURVE server (its ZAP handler checks clients)."""
        socket.curve_secretkey = self.server_secret
        socket.curve_publickey = self.server_public
        socket.curve_server = True

    def secure_client(self, socket: zmq.Socket) -> None:
        """An engine's end: a CURVE client that knows the frontend's public key."""
        socket.curve_secretkey = self.client_secret
        socket.curve_publickey = self.client_public
        socket.curve_serverkey = self.server_public


def _derived_key(secret: bytes, purpose: bytes) -> bytes:
    """A CURVE secret key (z85) for one purpose, from the shared secret."""
    digest = hashlib.blake2b(secret, digest_size=32, person=purpose.ljust(16, b"\0")[:16])
    return z85.encode(digest.digest())
