"""Pooled keep-alive HTTP/1.1 connections to the upstream replicas (the policy servers).

Each connection is an ``asyncio.Protocol`` that parses the response framing (content-length, chunked, or
until-close) and hands the de-chunked body straight to the call's :class:`Sink` as bytes arrive, so a
streamed response reaches the harness without a task switch. A connection goes back to its replica's idle
list when a response ends cleanly with keep-alive; anything else closes it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from typing import Protocol
from urllib.parse import urlsplit

from clawpipe.errors import ConfigError
from clawpipe.proxy.framing import MAX_CHUNK_LINE, MAX_HEAD, check_response_head
from clawpipe.proxy.wire import chunk_size

log = logging.getLogger(__name__)


class Sink(Protocol):
    """What an upstream connection reports to (one call at a time)."""

    def up_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...
    def up_body(self, data: bytes) -> None: ...
    def up_end(self) -> None: ...
    def up_fail(self, exc: BaseException, got_bytes: bool) -> None: ...


class UpstreamClosed(ConnectionError):
    """The upstream closed the connection before the response was complete."""


MAX_INTERIM = 16  # interim (1xx) responses taken before the final one

_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER, _UNTIL_CLOSE, _DONE = range(8)


class UpstreamConn(asyncio.Protocol):
    """One keep-alive connection; carries one request/response at a time."""

    __slots__ = (
        "_buf",
        "_interim",
        "_keep_alive",
        "_left",
        "_state",
        "got_bytes",
        "last_activity",
        "loop",
        "paused",
        "replica",
        "sink",
        "transport",
        "usable",
    )

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.loop = replica.loop
        self.transport: asyncio.Transport | None = None
        self.sink: Sink | None = None
        self.usable = False
        self.paused = False  # reading paused for a slow client
        self._buf = b""
        self._state = _DONE
        self._left = 0
        self._keep_alive = True
        self._interim = 0  # interim (1xx) heads of the current response
        self.got_bytes = False
        self.last_activity = 0.0

    # --- asyncio callbacks -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.usable = True

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.usable = False
        self.replica.closed(self)
        sink, self.sink = self.sink, None
        if sink is None:
            return
        if self._state == _UNTIL_CLOSE:
            self._state = _DONE
            sink.up_end()
            return
        sink.up_fail(exc or UpstreamClosed("upstream closed the connection mid-response"), self.got_bytes)

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is None:  # unsolicited bytes: the connection is out of sync
            self.abort()
            return
        self.got_bytes = True
        self.last_activity = self.loop.time()
        if self._buf:
            data = self._buf + data
            self._buf = b""
        state = self._state
        if state == _LENGTH:
            self.data_received_body(data)
            return
        if state == _UNTIL_CLOSE:
            sink.up_body(data)
            return
        if state == _HEAD:
            rest = self._read_head(sink, data)
            if rest is None or self.sink is None:  # more to come, failed, or the call was cancelled in up_head
                return
            data = rest
            if self._state == _DONE:
                self._finish()
                return
            if self._state == _LENGTH:
                if data:
                    self.data_received_body(data)
                return
            if self._state == _UNTIL_CLOSE:
                if data:
                    sink.up_body(data)
                return
            if not data:
                return
        self._chunked(data)

    def data_received_body(self, data: bytes) -> None:
        """Body bytes under content-length framing (a read of its own, or the rest of the head's read)."""
        sink = self.sink
        assert sink is not None
        n = len(data)
        if n < self._left:
            self._left -= n
            sink.up_body(data)
            return
        if n > self._left:
            self.abort()
            sink.up_fail(UpstreamClosed("upstream sent more bytes than its content-length"), True)
            return
        self._left = 0
        sink.up_body(data)
        self._finish()

    # --- framing -----------------------------------------------------------------------------------
    def _read_head(self, sink: Sink, data: bytes) -> bytes | None:
        """Take the final response head from ``data``, skipping interim (1xx) ones, and report it to ``sink``;
        returns the bytes after it, or None when the head is incomplete (kept for the next read) or bad."""
        while True:
            end = data.find(b"\r\n\r\n")
            if end > MAX_HEAD:
                end = -1  # too large: reported below as if the head had not ended
            if end < 0:
                if len(data) > MAX_HEAD:
                    self.abort()
                    sink.up_fail(UpstreamClosed("upstream response head too large"), True)
                else:
                    self._buf = data
                return None
            try:
                status, headers = self._parse_head(data[:end])
            except ValueError as exc:
                self.abort()
                sink.up_fail(UpstreamClosed(f"malformed upstream response head: {exc}"), True)
                return None
            data = data[end + 4 :]
            if self._state != _HEAD:
                sink.up_head(status, headers)
                return data
            # an interim answer (100 Continue, 103 Early Hints): the final one follows on the same connection
            self._interim += 1
            if self._interim > MAX_INTERIM:
                self.abort()
                sink.up_fail(UpstreamClosed(f"upstream sent more than {MAX_INTERIM} interim (1xx) responses"), True)
                return None

    def _parse_head(self, head: bytes) -> tuple[int, list[tuple[bytes, bytes]]]:
        """The status and headers of a response head; sets the body's framing (an interim 1xx head leaves the
        connection waiting for the next head)."""
        framing = check_response_head(head)  # ValueError: ambiguous or malformed framing -> 502
        status = framing.status
        if 100 <= status < 200:
            if status == 101:  # the proxy never asks for an upgrade
                raise ValueError("101 Switching Protocols to a request that asked for no upgrade")
            return status, framing.headers
        self._keep_alive = framing.keep_alive
        if status in (204, 304):
            self._state = _DONE
        elif framing.chunked:
            self._state = _CHUNK_SIZE
        elif framing.length >= 0:
            self._left = framing.length
            self._state = _LENGTH if framing.length else _DONE
        else:
            self._keep_alive = False
            self._state = _UNTIL_CLOSE
        return status, framing.headers

    def _chunked(self, data: bytes) -> None:
        sink = self.sink
        assert sink is not None
        pos, n = 0, len(data)
        out: list[bytes] = []
        while pos < n:
            state = self._state
            if state == _CHUNK_DATA:
                take = min(self._left, n - pos)
                out.append(data[pos : pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = _CHUNK_CRLF
                    self._left = 2
            elif state == _CHUNK_CRLF:
                if n - pos < 2:
                    self._buf = data[pos:]
                    break
                if data[pos : pos + 2] != b"\r\n":
                    self.abort()
                    sink.up_fail(UpstreamClosed("upstream chunk data not followed by CRLF"), True)
                    return
                pos += 2
                self._state = _CHUNK_SIZE
            elif state == _CHUNK_SIZE:
                nl = data.find(b"\r\n", pos)
                if nl < 0:
                    if n - pos > MAX_CHUNK_LINE:
                        self.abort()
                        sink.up_fail(UpstreamClosed("upstream chunk-size line too long"), True)
                        return
                    self._buf = data[pos:]
                    break
                line = data[pos:nl]
                pos = nl + 2
                try:
                    size = chunk_size(line)
                except ValueError:
                    self.abort()
                    sink.up_fail(UpstreamClosed("malformed chunk size from upstream"), True)
                    return
                if size == 0:
                    self._state = _TRAILER
                else:
                    self._state = _CHUNK_DATA
                    self._left = size
            elif state == _TRAILER:
                if data.startswith(b"\r\n", pos):
                    pos += 2
                    self._state = _DONE
                    break
                end = data.find(b"\r\n\r\n", pos)
                if end < 0:
                    if n - pos > MAX_HEAD:
                        self.abort()
                        sink.up_fail(UpstreamClosed("upstream trailer section too large"), True)
                        return
                    self._buf = data[pos:]
                    break
                pos = end + 4
                self._state = _DONE
                break
            else:
                break
        if out:
            sink.up_body(out[0] if len(out) == 1 else b"".join(out))
        if self._state == _DONE and self.sink is not None:
            self._finish()

    def _finish(self) -> None:
        sink, self.sink = self.sink, None
        self._state = _DONE
        self._buf = b""
        if self._keep_alive and self.usable:
            self.replica.release(self)
        else:
            self.abort()
        if sink is not None:
            sink.up_end()

    # --- use -----------------------------------------------------------------------------------------
    def send(self, request: bytes, sink: Sink) -> None:
        """Write one request; the response is reported to ``sink``."""
        self.sink = sink
        self._state = _HEAD
        self._buf = b""
        self._interim = 0
        self.got_bytes = False
        self.last_activity = self.loop.time()
        assert self.transport is not None
        self.transport.write(request)

    def pause(self) -> None:
        """Stop reading: the client reads slower than the upstream sends (backpressure)."""
        if self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and self.paused:
            self.paused = False
            self.transport.resume_reading()

    def detach(self) -> None:
        """Stop reporting to the current sink and drop the connection (the call was cancelled)."""
        self.sink = None
        self.abort()

    def abort(self) -> None:
        self.usable = False
        if self.transport is not None:
            self.transport.abort()


class Replica:
    """One upstream server: base URL and a bounded pool of keep-alive connections.

    At most ``max_conns`` connections are open at once; a call that finds none idle and the pool full waits
    in line (first come, first served) for one to be released or closed.
    """

    def __init__(
        self,
        url: str,
        loop: asyncio.AbstractEventLoop,
        *,
        connect_timeout_s: float = 5.0,
        max_idle: int = 256,
        max_conns: int = 256,
        api_key: str | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ConfigError(f"upstream {url!r}: use http://HOST:PORT[/prefix] (https upstreams are not supported)")
        self.url = url.rstrip("/")
        self.host = parts.hostname
        self.port = parts.port or 80
        prefix = parts.path.rstrip("/")
        if prefix.endswith("/v1"):  # accept ".../v1" as given to SDKs; paths forwarded already start with /v1
            prefix = prefix[:-3]
        self.prefix = prefix
        self.host_header = f"{self.host}:{self.port}".encode()
        self.auth_header = b"authorization: Bearer " + api_key.encode() + b"\r\n" if api_key else b""
        self.loop = loop
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = min(max_idle, max_conns)
        self.max_conns = max_conns
        self.idle: list[UpstreamConn] = []
        self.open = 0  # connections open or being opened
        self.peak = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._live: set[UpstreamConn] = set()
        # rotation state, kept by clawpipe.proxy.replicas.ReplicaSet
        self.in_flight = 0  # calls assigned to this replica and not yet ended (waiting for a connection too)
        self.calls = 0  # calls sent here since start
        self.draining = False  # out of rotation for new calls; in-flight ones finish
        self.down_until = 0.0  # loop time until which the replica is skipped after a failure
        self.failures = 0  # consecutive failures (the back-off doubles with each)
        self.errors = 0  # failures since start
        self.last_error: str | None = None

    async def acquire(self) -> tuple[UpstreamConn, bool]:
        """An idle connection (reused=True) or a new one, waiting while the pool is full; raises
        OSError/TimeoutError if the upstream is unreachable."""
        idle = self.idle
        while True:
            while idle:
                conn = idle.pop()
                if conn.usable:
                    return conn, True
            if self.open < self.max_conns:
                break
            fut: asyncio.Future[None] = self.loop.create_future()
            self._waiters.append(fut)
            try:
                await fut
            except BaseException:
                if not fut.cancelled() and fut.done():
                    self._wake()  # a wake-up meant for this call goes to the next one
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
                raise
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: UpstreamConn(self), self.host, self.port),
                self.connect_timeout_s,
            )
        except BaseException:
            self.open -= 1
            self._wake()
            raise
        if not conn.usable:  # lost before it could be used
            self.open -= 1
            self._wake()
            raise ConnectionError(f"upstream {self.url} closed the connection at once")
        self._live.add(conn)
        return conn, False

    @property
    def waiting(self) -> int:
        """Calls waiting for a connection."""
        return len(self._waiters)

    def _wake(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def release(self, conn: UpstreamConn) -> None:
        if len(self.idle) < self.max_idle:
            # paused for a slow client (backpressure) by the read that ended its response: a pooled connection
            # that does not read would leave the next call's answer unread until it timed out
            conn.resume()
            self.idle.append(conn)
            self._wake()
        else:
            conn.abort()  # its connection_lost frees the slot

    def closed(self, conn: UpstreamConn) -> None:
        """A connection of this pool is gone: its slot goes to the next waiting call."""
        if conn in self._live:
            self._live.discard(conn)
            self.open -= 1
            self._wake()

    def stop_waiting(self) -> None:
        """Calls still waiting for a connection fail (the proxy is stopping)."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(ConnectionError("the proxy is shutting down"))

    def close(self) -> None:
        for conn in self.idle:
            conn.abort()
        self.idle.clear()
        self.stop_waiting()

    def request_bytes(self, method: str, target: str, headers: bytes, body: bytes) -> bytes:
        """The request line, headers and body to send to this replica."""
        return b"".join(
            (
                method.encode(),
                b" ",
                self.prefix.encode(),
                target.encode(),
                b" HTTP/1.1\r\nhost: ",
                self.host_header,
                b"\r\naccept-encoding: identity\r\n",  # answers the proxy reads: clawpipe.proxy.coding
                self.auth_header,
                headers,
                b"content-length: %d\r\n\r\n" % len(body),
                body,
            )
        )
