"""ZeroMQ socket helpers: ipc endpoints inside a private (0700) runtime directory."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import zmq

# A slow consumer must never make the engine's send block forever nor lose frames silently:
# high-water marks are generous, and senders use a linger so shutdown does not hang.
HIGH_WATER_MARK = 100_000
LINGER_MS = 1000


@dataclass(slots=True)
class Endpoints:
    requests: str  # frontend PUSH -> engine PULL
    outputs: str  # engine PUSH -> frontend PULL
    runtime_dir: str | None = None

    @classmethod
    def private_ipc(cls) -> Endpoints:
        runtime_dir = tempfile.mkdtemp(prefix="loom-")  # mkdtemp creates it with mode 0700
        os.chmod(runtime_dir, 0o700)
        return cls(
            requests=f"ipc://{runtime_dir}/requests",
            outputs=f"ipc://{runtime_dir}/outputs",
            runtime_dir=runtime_dir,
        )

    def remove(self) -> None:
        if self.runtime_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)


def is_tcp(address: str) -> bool:
    return address.startswith("tcp://")


def make_socket(context: zmq.Context, kind: int, address: str, bind: bool,
                secure: Callable[[zmq.Socket], None] | None = None) -> zmq.Socket:
    """`secure` sets the socket's security options (common.curve) before it binds or
    connects."""
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, LINGER_MS)
    socket.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
    socket.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
    socket.setsockopt(zmq.MAXMSGSIZE, 256 * 1024 * 1024)
    if secure is not None:
        secure(socket)
    try:
        if bind:
            socket.bind(address)
        else:
            socket.connect(address)
    except zmq.ZMQError:
        socket.close(linger=0)  # else the context's term waits on it
        raise
    return socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (yet)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
