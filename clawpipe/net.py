"""Sockets shared by the rooms that accept TCP connections (the serving engine, the sandbox bridge)."""

from __future__ import annotations

import socket


def tcp_socket() -> socket.socket:
    """An IPv4 TCP socket whose accepted connections asyncio sets TCP_NODELAY on: it does so only when proto is
    IPPROTO_TCP, and without it a reply written in two pieces (head, then body) waits ~40 ms for the peer's
    delayed ACK (Nagle)."""
    return socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
