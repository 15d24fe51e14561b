"""The network bridge: the only way out of a sandbox, to the proxy and nowhere else.

A sandbox has its own network namespace with nothing but ``lo``. For each sandbox the host opens a
listening socket *inside that namespace* (a short-lived thread ``setns``-es into it, binds
127.0.0.1:PORT and exits), so no process runs in the sandbox for networking. One asyncio loop on a
host thread accepts on all such listeners and forwards each connection to the proxy's real address.
A connection arrives on a listener that belongs to exactly one rollout, so the bridge can count that
rollout's requests without trusting anything the harness sends.

One sandbox cannot starve another: each route holds at most ``max_connections`` open connections (each
costs the runner two descriptors, so a sandbox's share of the runner's descriptors is bounded); one more
is refused at once with a reset and counted, and a sandbox at its cap is accepted from at most every
``REFUSE_PAUSE_S``, so a connect loop cannot monopolise the bridge's event loop. Connections with no
bytes either way for ``idle_timeout_s`` are closed.
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
import struct
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from clawpipe.errors import ConfigError, SandboxError
from clawpipe.net import tcp_socket

logger = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
DEFAULT_MAX_CONNECTIONS = 64  # per sandbox; a harness's SDK keeps a handful (one per call in flight)
DEFAULT_IDLE_TIMEOUT_S = 300.0  # generous: a non-streamed call to a slow model sends nothing until it is done
REFUSE_PAUSE_S = 0.01  # a sandbox at its cap is refused at most ~100 times a second; the rest wait in its backlog
LISTEN_BACKLOG = 128
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
            sock.listen(LISTEN_BACKLOG)
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
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


def _reset(conn: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0): the client sees ECONNRESET at once and no TIME_WAIT is left."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


class _RequestCounter:
    """Counts HTTP/1.1 requests in a client byte stream (Content-Length and chunked bodies).

    Linear in the bytes fed however the stream is cut: a head is searched for from where the last search
    stopped, and the buffer never holds more than one unfinished head (a harness writing a byte at a time
    would otherwise make the bridge's thread copy and search its whole buffer again for every byte)."""

    def __init__(self) -> None:
        self.count = 0
        self._buf = bytearray()
        self._scan = 0  # where the next search of _buf starts: no match can end before it
        self._body_left = 0
        self._chunked = False
        self._lost = False  # a head past 64 KB: not HTTP this counts, so the rest of the stream is not read

    def feed(self, data: bytes) -> None:
        buf = self._buf
        if self._lost or self._body_left >= len(data):  # body bytes pass without being buffered
            self._body_left -= len(data)
            return
        buf += data
        while True:
            if self._body_left:
                take = min(self._body_left, len(buf))
                del buf[:take]
                self._body_left -= take
                if self._body_left:
                    return
                self._scan = 0
            if self._chunked:
                end = buf.find(b"0\r\n\r\n", self._scan)
                if end < 0:
                    del buf[:-4]  # the end marker may straddle the next read
                    self._scan = 0
                    return
                del buf[: end + 5]
                self._scan = 0
                self._chunked = False
            head_end = buf.find(b"\r\n\r\n", self._scan)
            if head_end < 0:
                if len(buf) > 65536:  # not HTTP we understand: stop counting, keep forwarding
                    buf.clear()
                    self._lost = True
                self._scan = max(0, len(buf) - 3)
                return
            head = bytes(buf[:head_end]).decode("latin-1").lower()
            del buf[: head_end + 4]
            self._scan = 0
            self.count += 1
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip() == "content-length":
                    with contextlib.suppress(ValueError):
                        self._body_left = int(value.strip())
                elif name.strip() == "transfer-encoding" and "chunked" in value:
                    self._chunked = True


class _Conn:
    """One forwarded connection: its handler task and when a byte last passed either way."""

    __slots__ = ("last", "task")

    def __init__(self, task: asyncio.Task[None], now: float) -> None:
        self.task = task
        self.last = now


@dataclass(eq=False)  # compared and hashed by identity: the bridge keeps a set of live routes
class Route:
    """One sandbox's listener and what passed through it."""

    port: int
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    connections: int = 0
    requests: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    unreachable: int = 0  # connections that could not be forwarded because the proxy did not answer
    refused: int = 0  # connections refused because the sandbox already had max_connections open
    idle_closed: int = 0  # connections closed after idle_timeout_s without a byte either way
    peak_open: int = 0
    errors: list[str] = field(default_factory=list)
    _acceptor: asyncio.Task[None] | None = None
    _conns: dict[asyncio.Task[None], _Conn] = field(default_factory=dict)
    _slot_free: asyncio.Event | None = None

    @property
    def open(self) -> int:
        return len(self._conns)


class Bridge:
    """One event loop thread that forwards every sandbox's listener to the proxy. Use as a context manager.

    ``max_connections`` caps each sandbox's open connections; ``idle_timeout_s`` closes a connection that
    carried no byte either way for that long.
    """

    def __init__(
        self,
        proxy_url: str,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        if max_connections < 1 or idle_timeout_s <= 0:
            raise ConfigError(
                f"bridge max_connections must be >= 1 and idle_timeout_s > 0, "
                f"got {max_connections} and {idle_timeout_s}"
            )
        self.target = parse_proxy_url(proxy_url)
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self._routes: set[Route] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="clawpipe-bridge", daemon=True)
        self._thread.start()
        self._sweeper = self._call(self._start_sweeper())

    def _call(self, coro: object, timeout: float = 10.0) -> object:
        fut: Future[object] = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        return fut.result(timeout)

    def attach(self, sock: socket.socket) -> Route:
        """Start forwarding connections accepted on ``sock`` (which the bridge now owns)."""
        route = Route(port=sock.getsockname()[1], max_connections=self.max_connections)
        self._call(self._start(route, sock))
        return route

    def detach(self, route: Route) -> None:
        """Stop accepting and drop open connections of one sandbox."""
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._call(self._stop(route))

    async def _start_sweeper(self) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self._sweep_idle())

    async def _sweep_idle(self) -> None:
        """Close connections idle for longer than idle_timeout_s (checked a few times per timeout)."""
        loop = asyncio.get_running_loop()
        period = max(0.05, min(self.idle_timeout_s / 4, 5.0))
        while True:
            await asyncio.sleep(period)
            cutoff = loop.time() - self.idle_timeout_s
            for route in list(self._routes):
                for conn in list(route._conns.values()):
                    if conn.last < cutoff and not conn.task.done():
                        route.idle_closed += 1
                        conn.task.cancel()

    async def _start(self, route: Route, sock: socket.socket) -> None:
        route._slot_free = asyncio.Event()
        route._acceptor = asyncio.get_running_loop().create_task(self._accept(route, sock))
        self._routes.add(route)

    async def _accept(self, route: Route, sock: socket.socket) -> None:
        """Accept one connection at a time; over the cap, reset it and pause until a slot frees (or briefly)."""
        loop = asyncio.get_running_loop()
        assert route._slot_free is not None
        try:
            while True:
                conn, _ = await loop.sock_accept(sock)
                if route.open >= route.max_connections:
                    route.refused += 1
                    _reset(conn)
                    route._slot_free.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(route._slot_free.wait(), REFUSE_PAUSE_S)
                    continue
                task = loop.create_task(self._handle(route, conn))
                route._conns[task] = _Conn(task, loop.time())
                route.peak_open = max(route.peak_open, route.open)
        finally:
            sock.close()

    async def _handle(self, route: Route, conn: socket.socket) -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            reader, writer = await asyncio.open_connection(sock=conn)
            await self._forward(route, route._conns[task], reader, writer)
        except asyncio.CancelledError:
            pass  # detach or the idle sweep dropped it; ending normally keeps asyncio (3.11) quiet
        except OSError:
            conn.close()
        finally:
            route._conns.pop(task, None)
            if route._slot_free is not None:
                route._slot_free.set()

    async def _shutdown(self) -> None:
        self._sweeper.cancel()  # type: ignore[attr-defined]
        for route in list(self._routes):
            await self._stop(route)

    async def _stop(self, route: Route) -> None:
        self._routes.discard(route)
        if route._acceptor is not None:
            route._acceptor.cancel()
            await asyncio.gather(route._acceptor, return_exceptions=True)
        tasks = list(route._conns)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _forward(
        self, route: Route, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        route.connections += 1
        loop = asyncio.get_running_loop()
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
                    conn.last = loop.time()
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
        with contextlib.suppress(Exception):
            self._call(self._shutdown(), timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> Bridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
