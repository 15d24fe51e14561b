"""Per-connection and per-call protocol objects of the proxy.

:class:`ClientConn` parses a harness connection's requests (HTTP/1.1 keep-alive, one request at a time,
bodies bounded by the proxy's limit) and hands each to the server's handler. :class:`Call` is one forwarded
model call: the sink an upstream connection reports to. It streams SSE bytes to the harness as they arrive,
except the piece holding the stream's end marker, which it holds until the call's record is durable.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from clawpipe.proxy import wire
from clawpipe.proxy.upstream import UpstreamConn

if TYPE_CHECKING:
    from clawpipe.proxy.server import ProxyServer

# A stream's last event: from the piece that holds it on, bytes are held back until the record is durable.
# Matched at the start of an SSE line (newlines in generated text are escaped inside the JSON, so text that
# mentions "[DONE]" or "message_stop" never matches) and across read boundaries (the tail of earlier reads).
_LAST_EVENTS = (b"message_stop", b"response.completed", b"response.failed", b"response.incomplete")
END_MARKERS = (
    b"\ndata: [DONE]",
    b"\ndata:[DONE]",
    *(b"\nevent: " + e for e in _LAST_EVENTS),
    *(b"\nevent:" + e for e in _LAST_EVENTS),
    *(b'\ndata: {"type": "' + e + b'"' for e in _LAST_EVENTS),
    *(b'\ndata: {"type":"' + e + b'"' for e in _LAST_EVENTS),
)
_TAIL = max(len(m) for m in END_MARKERS)
MAX_HEAD = 65536


class ClientConn(asyncio.Protocol):
    """One harness connection: parses requests and runs them one at a time (keep-alive, in order)."""

    def __init__(self, proxy: ProxyServer) -> None:
        self.proxy = proxy
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.busy = False
        self.closed = False
        self.reading_paused = False
        self.call: Call | None = None
        self._head: tuple[str, str, bytes, dict[bytes, bytes], int, int] | None = None
        self._discard = 0  # bytes of a refused (413) body still to read and drop before closing
        self._close_pending = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.proxy._conns.add(self)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.proxy._conns.discard(self)
        call = self.call
        if call is not None:
            call.client_gone()

    def data_received(self, data: bytes) -> None:
        if self._discard:
            self._discard = max(0, self._discard - len(data))
            if not self._discard and self._close_pending:
                self.close()
            return
        if self.busy:
            self.buf += data
            if len(self.buf) > self.proxy.config.max_body_bytes + MAX_HEAD and not self.reading_paused:
                self.reading_paused = True
                assert self.transport is not None
                self.transport.pause_reading()
            return
        if self.buf:
            self.buf += data
            self._parse(self.buf)
        else:
            self._parse(data)

    def pause_writing(self) -> None:
        """The harness reads slower than the upstream writes: stop reading the upstream (backpressure)."""
        up = self.call.up if self.call is not None else None
        if up is not None and up.transport is not None:
            up.transport.pause_reading()

    def resume_writing(self) -> None:
        up = self.call.up if self.call is not None else None
        if up is not None and up.transport is not None:
            up.transport.resume_reading()

    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True

    def _parse(self, data: bytes | bytearray) -> None:
        while not self.busy and not self.closed:
            if self._head is None:
                end = data.find(b"\r\n\r\n")
                if end < 0:
                    if len(data) > MAX_HEAD:
                        self.write(wire.error_response(431, "request head too large", anthropic=False))
                        self.close()
                    elif data is not self.buf:
                        self.buf = bytearray(data)
                    return
                try:
                    method, target, version, headers = wire.parse_head(bytes(data[:end]))
                    clen = int(headers.get(b"content-length", b"0"))
                    if clen < 0:
                        raise ValueError
                except (wire.BadRequest, ValueError):
                    self.write(wire.error_response(400, "malformed HTTP request", anthropic=False, keep_alive=False))
                    self.close()
                    return
                if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
                    clen = -1  # de-chunked once complete (wire.dechunk)
                self._head = (method, target, version, headers, end + 4, clen)
                if clen > self.proxy.config.max_body_bytes:
                    self._head = None
                    self.buf = bytearray()
                    self._discard = max(0, clen - (len(data) - end - 4))
                    req = self._request(method, target, version, headers, b"")
                    req.keep_alive = False
                    req.extra["too_large"] = clen
                    self._dispatch(req)
                    return
                if headers.get(b"expect", b"").lower() == b"100-continue" and (clen < 0 or len(data) < end + 4 + clen):
                    self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            method, target, version, headers, start, clen = self._head
            if clen >= 0:
                need = start + clen
                done = len(data) >= need
            else:
                try:
                    whole = wire.dechunk(data, start, self.proxy.config.max_body_bytes)
                except wire.BadRequest as exc:
                    if exc.status == 413:  # answered and captured like an over-limit content-length body
                        self._head, self.buf, self._discard = None, bytearray(), 1 << 62
                        req = self._request(method, target, version, headers, b"")
                        req.keep_alive = False
                        req.extra["too_large"] = f"more than {self.proxy.config.max_body_bytes}"
                        self._dispatch(req)
                        return
                    self.write(wire.error_response(exc.status, str(exc), anthropic=False, keep_alive=False))
                    self.close()
                    return
                done = whole is not None
            if not done:
                if data is not self.buf:
                    self.buf = bytearray(data)
                return
            if clen >= 0:
                body = bytes(data[start:need])
            else:
                assert whole is not None
                body, need = whole
            self._head = None
            if data is self.buf:
                del self.buf[:need]
            else:
                self.buf = bytearray(data[need:]) if len(data) > need else bytearray()
            data = self.buf
            self._dispatch(self._request(method, target, version, headers, body))

    @staticmethod
    def _request(method: str, target: str, version: bytes, headers: dict[bytes, bytes], body: bytes) -> wire.Request:
        path, _, query = target.partition("?")
        keep = version == b"HTTP/1.1"
        conn_h = headers.get(b"connection")
        if conn_h is not None:
            low = conn_h.lower()
            if b"close" in low:
                keep = False
            elif b"keep-alive" in low:
                keep = True
        return wire.Request(method, target, path, query, version, headers, body, keep)

    def _dispatch(self, req: wire.Request) -> None:
        self.busy = True
        self.proxy._track(self.proxy._loop.create_task(self.proxy._handle(self, req)))

    def finish(self, keep_alive: bool) -> None:
        """The current request is answered: go on with the next one, or close."""
        self.busy = False
        self.call = None
        if not keep_alive:
            if self._discard and not self.closed:  # closing with unread input would reset the connection
                self._close_pending = True
                self.proxy._loop.call_later(30, self.close)
            else:
                self.close()
            return
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()
        if self.buf and not self.closed:
            self._parse(self.buf)


class Call:
    """One forwarded model call: the upstream's :class:`~clawpipe.proxy.upstream.Sink` and its outcome."""

    __slots__ = (
        "chunked",
        "client",
        "error",
        "fut",
        "held",
        "holding",
        "outcome",
        "parts",
        "resp_headers",
        "status",
        "stream",
        "streaming",
        "tail",
        "up",
    )

    def __init__(self, client: ClientConn, stream: bool, loop: asyncio.AbstractEventLoop, chunked: bool = True) -> None:
        self.client = client
        self.chunked = chunked  # stream to the client in chunked encoding (HTTP/1.1), else until close
        self.stream = stream
        self.fut: asyncio.Future[None] = loop.create_future()
        self.parts: list[bytes] = []
        self.held: list[bytes] = []
        self.holding = False
        self.tail = b"\n"  # the stream so far ends here: its first line starts a line too
        self.streaming = False
        self.status = 0
        self.resp_headers: list[tuple[bytes, bytes]] = []
        self.outcome = ""  # end | fail | timeout | cancelled
        self.error: str | None = None
        self.up: UpstreamConn | None = None

    def _resolve(self, outcome: str, error: str | None = None) -> None:
        if not self.fut.done():
            self.outcome, self.error = outcome, error
            self.fut.set_result(None)

    # --- Sink ----------------------------------------------------------------------------------------
    def up_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.resp_headers = [(n, v) for n, v in headers if n not in wire.HOP_BY_HOP]
        if self.stream and status == 200:
            self.streaming = True
            self.client.write(wire.response_head(200, self.resp_headers, length=None if self.chunked else -1))

    def up_body(self, data: bytes) -> None:
        self.parts.append(data)
        if self.streaming:
            chunk = b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data
            if not self.holding:
                edge = self.tail + data[:_TAIL]  # a marker across the read boundary
                self.holding = any(m in data or m in edge for m in END_MARKERS)
                self.tail = data[-_TAIL:] if len(data) >= _TAIL else (self.tail + data)[-_TAIL:]
            if self.holding:
                self.held.append(chunk)
            else:
                self.client.write(chunk)

    def up_end(self) -> None:
        self.up = None
        self._resolve("end")

    def up_fail(self, exc: BaseException, got_bytes: bool) -> None:
        self.up = None
        self._resolve("fail", f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)

    # --- proxy side ----------------------------------------------------------------------------------
    def client_gone(self) -> None:
        up, self.up = self.up, None
        if up is not None:
            up.detach()  # cancels the upstream request: its connection is dropped
        self._resolve("cancelled", "client disconnected before the response was complete")

    def shut_down(self) -> None:
        """The proxy is stopping: drop the upstream request; the call is captured as cancelled."""
        up, self.up = self.up, None
        if up is not None:
            up.detach()
        self._resolve("shutdown", "the proxy shut down before the response was complete")

    def timed_out(self, after_s: float) -> None:
        up, self.up = self.up, None
        if up is not None:
            up.detach()
        self._resolve("timeout", f"upstream sent nothing for {after_s:g} s")
