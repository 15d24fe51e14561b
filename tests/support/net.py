"""Socket checks shared by the serving and sandbox tests."""

from __future__ import annotations

import asyncio
import contextlib
import socket


def accepted_nodelay(listener: socket.socket) -> int:
    """TCP_NODELAY of a connection that plain asyncio accepts on ``listener`` (non-zero: set)."""

    async def check() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=listener)
        _, w = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        try:
            return await asyncio.wait_for(seen, 5)
        finally:
            w.close()
            server.close()

    return asyncio.run(check())


def read_all(s: socket.socket) -> bytes:
    """Everything ``s`` receives until the peer closes it, resets it or the socket's timeout passes."""
    out = b""
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while chunk := s.recv(65536):
            out += chunk
    return out
