"""A server started on a free port that someone else binds first starts again on another."""

from __future__ import annotations

import socket

import pytest

from tests.tiny_server import shared_tiny_model, tiny_server

pytestmark = pytest.mark.e2e


def test_a_free_port_taken_before_the_server_binds_it_is_replaced(tmp_path_factory) -> None:
    server = tiny_server(shared_tiny_model(tmp_path_factory), "--num-kv-blocks", "64")
    taken = server.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        try:
            server.start(tmp_path_factory.mktemp("logs"))
            assert server.port != taken and server.health_status() == 200
        finally:
            server.stop()
