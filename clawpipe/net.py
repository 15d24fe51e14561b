"""Sockets shared by the rooms that accept TCP connections (the serving engine, the sandbox bridge), the
one way to pick a free loopback port (the pipeline's services, the benches, the tests), and the one way to
ask whether a service the loop reports to (Prefect, MLflow) answers."""

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


def health_failure(base_url: str, timeout_s: float = 10.0) -> str | None:
    """Why the service at ``base_url`` does not answer ``GET <base_url>/health``, or None when it answers.

    Any HTTP status counts as an answer (an error status behind an auth proxy still means it is up)."""
    import http.client
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=timeout_s) as resp:
            resp.read()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        return str(getattr(exc, "reason", exc))
    return None
