"""Sockets shared by the rooms that accept TCP connections (the serving engine, the sandbox bridge), and the
one way to pick a free loopback port (the pipeline's services, the benches, the tests)."""

from __future__ import annotations

import socket


def tcp_socket() -> socket.socket:
    """An IPv4 TCP socket whose accepted connections asyncio sets TCP_NODELAY on: it does so only when proto is
    IPPROTO_TCP, and without it a reply written in two pieces (head, then body) waits ~40 ms for the peer's
    delayed ACK (Nagle)."""
    return socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now. The socket is closed before returning, so
    another process may take the port before the caller binds it; callers that start a server on it fail
    loudly (address in use) rather than talk to a stranger."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
