"""The network bridge: the only way out of a sandbox, to the proxy and nowhere else.

A sandbox has its own network namespace with nothing but ``lo``. For each sandbox the host opens a
listening socket *inside that namespace* (a short-lived thread ``setns``-es into it, binds
127.0.0.1:PORT and exits), so no process runs in the sandbox for networking. One asyncio loop on a
host thread accepts on all such listeners and forwards each connection to the proxy's real address.
A connection arrives on a listener that belongs to exactly one rollout, so the bridge can count that
rollout's requests without trusting anything the harness sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from clawpipe.errors import ConfigError, SandboxError
from clawpipe.net import tcp_socket

logger = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def parse_proxy_url(url: str) -> tuple[str, int]:
    """(host, port) of the proxy's real address from a URL like http://127.0.0.1:8000."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ConfigError(f"proxy URL {url!r} must look like http://HOST:PORT (the capture proxy's address)")
    return parts.hostname, parts.port or 80


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


def listen_in_netns(pid: int, port: int, wait_s: float = 5.0) -> socket.socket:
    """A socket listening on 127.0.0.1:port inside the network namespace of process ``pid``.

    Runs in a throwaway thread because setns changes the calling thread's namespace for good. The
    sandbox's own setup configures ``lo`` concurrently (bwrap does it after reporting its pid), so
    this never touches the interface: it retries the bind until 127.0.0.1 exists there.
    """
    result: dict[str, object] = {}

    def enter_and_bind() -> None:
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(fd)
            finally:
                os.close(fd)
            sock = tcp_socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    sock.bind(("127.0.0.1", port))
                    break
                except OSError as exc:
                    if exc.errno != errno.EADDRNOTAVAIL or time.monotonic() > deadline:
                        sock.close()
                        raise
                    time.sleep(0.0005)
            sock.listen(128)
            sock.setblocking(False)
            result["sock"] = sock
        except OSError as exc:
            result["error"] = exc

    t = threading.Thread(target=enter_and_bind, name=f"netns-{pid}")
    t.start()
    t.join()
    if "error" in result:
        raise SandboxError(f"could not open the proxy port inside sandbox pid {pid}: {result['error']}")
    return result["sock"]  # type: ignore[return-value]


def listen_on_host() -> socket.socket:
    """A listener on an ephemeral 127.0.0.1 port in the host namespace (the process backend's bridge)."""
    sock = tcp_socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    return sock


class _RequestCounter:
    """Counts HTTP/1.1 requests in a client byte stream (Content-Length and chunked bodies)."""

    def __init__(self) -> None:
        self.count = 0
        self._buf = b""
        self._body_left = 0
        self._chunked = False

    def feed(self, data: bytes) -> None:
        self._buf += data
        while True:
            if self._body_left:
                take = min(self._body_left, len(self._buf))
                self._buf = self._buf[take:]
                self._body_left -= take
                if self._body_left:
                    return
            if self._chunked:
                end = self._buf.find(b"0\r\n\r\n")
                if end < 0:
                    self._buf = self._buf[-4:]
                    return
                self._buf = self._buf[end + 5 :]
                self._chunked = False
            head_end = self._buf.find(b"\r\n\r\n")
            if head_end < 0:
                if len(self._buf) > 65536:  # not HTTP we understand: stop counting, keep forwarding
                    self._buf = b""
                return
            head = self._buf[:head_end].decode("latin-1").lower()
            self._buf = self._buf[head_end + 4 :]
            self.count += 1
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip() == "content-length":
                    with contextlib.suppress(ValueError):
                        self._body_left = int(value.strip())
                elif name.strip() == "transfer-encoding" and "chunked" in value:
                    self._chunked = True


@dataclass
class Route:
    """One sandbox's listener and what passed through it."""

    port: int
    connections: int = 0
    requests: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    unreachable: int = 0  # connections that could not be forwarded because the proxy did not answer
    errors: list[str] = field(default_factory=list)
    _server: asyncio.AbstractServer | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)


class Bridge:
    """One event loop thread that forwards every sandbox's listener to the proxy. Use as a context manager."""

    def __init__(self, proxy_url: str) -> None:
        self.target = parse_proxy_url(proxy_url)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="clawpipe-bridge", daemon=True)
        self._thread.start()

    def _call(self, coro: object, timeout: float = 10.0) -> object:
        fut: Future[object] = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        return fut.result(timeout)

    def attach(self, sock: socket.socket) -> Route:
        """Start forwarding connections accepted on ``sock`` (which the bridge now owns)."""
        route = Route(port=sock.getsockname()[1])
        self._call(self._start(route, sock))
        return route

    def detach(self, route: Route) -> None:
        """Stop accepting and drop open connections of one sandbox."""
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._call(self._stop(route))

    async def _start(self, route: Route, sock: socket.socket) -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            route._tasks.add(task)
            try:
                await self._forward(route, reader, writer)
            except asyncio.CancelledError:
                pass  # detach dropped it; ending normally keeps asyncio (3.11) from logging the cancellation
            finally:
                route._tasks.discard(task)

        route._server = await asyncio.start_server(handle, sock=sock)

    async def _stop(self, route: Route) -> None:
        if route._server is not None:
            route._server.close()
        for task in list(route._tasks):
            task.cancel()
        if route._tasks:
            await asyncio.gather(*route._tasks, return_exceptions=True)

    async def _forward(self, route: Route, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        route.connections += 1
        counter = _RequestCounter()
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError as exc:
            route.unreachable += 1
            if len(route.errors) < 5:
                route.errors.append(f"proxy {self.target[0]}:{self.target[1]} unreachable: {exc}")
            writer.close()
            return

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, upstream: bool) -> None:
            try:
                while data := await src.read(65536):
                    if upstream:
                        route.bytes_up += len(data)
                        seen = counter.count
                        counter.feed(data)
                        route.requests += counter.count - seen
                    else:
                        route.bytes_down += len(data)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    if dst.can_write_eof():
                        dst.write_eof()

        try:
            await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False))
        finally:
            for w in (writer, up_writer):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> Bridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
