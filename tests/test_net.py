"""The one free-port helper: the port it names can be bound and served on loopback."""

from __future__ import annotations

import socket

from clawpipe.net import free_port


def test_free_port_names_a_port_a_server_can_bind_and_accept_on() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
        server.listen(1)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            conn, _ = server.accept()
            conn.close()


def test_free_port_after_close_refuses_connections() -> None:
    port = free_port()
    with socket.socket() as s:
        s.settimeout(5)
        assert s.connect_ex(("127.0.0.1", port)) != 0
