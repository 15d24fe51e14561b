"""One harness connection of the proxy (:class:`ClientConn`).

It parses the connection's requests (HTTP/1.1 keep-alive, one request at a time, framing per
:mod:`clawpipe.proxy.framing`, bodies bounded by the proxy's limits) and hands each to the server's handler;
its phase tells the proxy's sweep when a head, a body or an idle connection has taken too long.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Protocol

from clawpipe.proxy import wire
from clawpipe.proxy.call import Call
from clawpipe.proxy.config import ProxyConfig
from clawpipe.proxy.framing import MAX_HEAD, ChunkedBody, Head, parse_request_head
from clawpipe.proxy.limits import MIN_BODY_RATE, BodyBudget
from clawpipe.proxy.wire import BadRequest


class ConnOwner(Protocol):
    """What a connection needs from the proxy that accepted it (the server is one): its limits, its clock,
    its table of open connections and its request handler. The connection never touches more."""

    config: ProxyConfig
    body_budget: BodyBudget

    def now(self) -> float: ...

    def call_later(self, delay: float, fn: Callable[[], object]) -> None: ...

    def admit(self, conn: ClientConn) -> bool:
        """Count ``conn`` among the open connections; False when the proxy is at its connection limit."""
        ...

    def forget(self, conn: ClientConn) -> None: ...

    def serve(self, conn: ClientConn, req: wire.Request) -> None:
        """Answer ``req`` in a task of its own; the answer ends with :meth:`ClientConn.finish`."""
        ...


# Connection phases: waiting for (the rest of) a head, a body, the handler's answer, the next request.
HEAD, BODY, BUSY, IDLE = range(4)


class ClientConn(asyncio.Protocol):
    """One harness connection: parses requests and runs them one at a time (keep-alive, in order).

    Its ``phase`` and ``since`` let the proxy's sweep close connections that take too long to send a head
    or a body (408) or sit idle between requests.
    """

    def __init__(self, proxy: ConnOwner) -> None:
        self.proxy = proxy
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()  # input not consumed yet
        self.busy = False
        self.closed = False
        self.reading_paused = False
        self.call: Call | None = None
        self.phase = HEAD
        self.since = 0.0  # loop time the phase started (BODY: the last body bytes)
        self._body_since = 0.0  # loop time the current body started
        self._head: Head | None = None
        self._parts: list[bytes] = []  # Content-Length body so far
        self._have = 0
        self._chunks: ChunkedBody | None = None
        self._held = 0  # bytes this connection holds of the proxy's body budget
        self._head_scanned = 0  # bytes of an incomplete head already searched for its end
        self._discard = 0  # bytes of a refused body still to read and drop before closing
        self._close_pending = False
        self._dropped = False  # the input being parsed was refused: drop what is left of it
        self.refused = False  # answered without reading (over the connection limit, HTTP/2) and closing
        self._bodiless = 0  # answering a HEAD request: 1 until its head is written, then 2 (the rest dropped)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.since = self.proxy.now()
        if not self.proxy.admit(self):
            self._refuse_connection()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.proxy.forget(self)
        self._release()
        call = self.call
        if call is not None:
            call.client_gone()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self._discard:
            self._discard = max(0, self._discard - len(data))
            if not self._discard and self._close_pending:
                self.close()
            return
        if self.busy:  # a pipelined next request: keep a head's worth, then stop reading
            self.buf += data
            if len(self.buf) > 2 * MAX_HEAD and not self.reading_paused:
                self.reading_paused = True
                assert self.transport is not None
                self.transport.pause_reading()
            return
        if self.phase == IDLE:
            self.phase, self.since = HEAD, self.proxy.now()
        elif self.phase == BODY:
            self.since = self.proxy.now()
        if self.buf:
            self.buf += data
            self._parse(None)
        else:
            self._parse(data)

    def pause_writing(self) -> None:
        """The harness reads slower than the upstream writes: stop reading the upstream (backpressure)."""
        up = self.call.up if self.call is not None else None
        if up is not None:
            up.pause()

    def resume_writing(self) -> None:
        up = self.call.up if self.call is not None else None
        if up is not None:
            up.resume()

    def write(self, data: bytes) -> None:
        if self.closed or self.transport is None:
            return
        if self._bodiless:  # RFC 9110: a response to HEAD has no content (a client would read it as the next one)
            if self._bodiless == 2:
                return
            end = data.find(b"\r\n\r\n")
            if end >= 0:
                data, self._bodiless = data[: end + 4], 2
        self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True
        self._release()

    def time_out(self, now: float) -> bool:
        """Close the connection if its phase ran past its limit (the proxy's sweep calls this)."""
        cfg = self.proxy.config
        if self.phase == IDLE:
            if now - self.since > cfg.idle_timeout_s:
                self.close()
                return True
        elif self.phase in (HEAD, BODY) and now - self.since > cfg.header_timeout_s:
            what = "request head" if self.phase == HEAD else "rest of the request body"
            self._time_out(f"the {what} did not arrive within {cfg.header_timeout_s:g} s")
            return True
        elif self.phase == BODY and now - self._body_since > cfg.header_timeout_s + self._received() / MIN_BODY_RATE:
            # a body trickled in without ever pausing long would hold its connection and buffer forever
            rate = MIN_BODY_RATE / (1 << 20)
            self._time_out(
                f"the request body arrived slower than {rate:g} MiB/s on average after its first "
                f"{cfg.header_timeout_s:g} s: send it at once"
            )
            return True
        return False

    def _time_out(self, message: str) -> None:
        self.write(wire.error_response(408, message, anthropic=None, keep_alive=False))
        self.close()

    def _received(self) -> int:
        """Body bytes of the current request received so far."""
        return self._chunks.size if self._chunks is not None else self._have

    # --- parsing -------------------------------------------------------------------------------------
    def _parse(self, data: bytes | None) -> None:
        """Parse requests from ``data`` (a fresh read while nothing is buffered) or from ``self.buf``; what is
        left unconsumed stays in ``self.buf``. A fresh read is parsed where it lies, not copied first."""
        src: bytes | bytearray = self.buf if data is None else data
        pos = 0
        self._dropped = False
        while not self.busy and not self.closed:
            if self._head is None:
                after = self._read_head(src, pos)
                if after < 0:
                    break
                pos = after
                continue
            pos = self._body_bytes(src, pos)
            if self._head is None or self.closed:
                continue
            if not self._body_done():
                break
            self._dispatch_body()
        if self._dropped:  # refused or rejected: nothing after it is parsed
            self.buf = bytearray()
        elif src is self.buf:
            if pos > 0:
                del self.buf[:pos]
        elif pos < len(src):
            self.buf = bytearray(src[pos:] if pos else src)

    def _read_head(self, src: bytes | bytearray, pos: int) -> int:
        """Take a complete head from ``src`` at ``pos``: the position after it, or -1 (need more, or refused)."""
        if src.startswith(b"\r\n", pos):  # empty lines before a request line are ignored (RFC 9112 2.2): some
            end = pos + 2  # clients end a body with a CRLF more than its length holds
            while src.startswith(b"\r\n", end):
                end += 2
            self._head_scanned = 0  # the head timeout runs on: empty lines alone never hold a connection open
            return end
        start = pos + max(0, self._head_scanned - 3)  # an incomplete head is not searched again
        end = src.find(b"\r\n\r\n", start)
        if end < 0:
            self._head_scanned = len(src) - pos  # what is left goes to buf, from its start
            if len(src) - pos > MAX_HEAD:  # checked on every read: a head never grows past the limit
                self._reject(431, f"request head larger than {MAX_HEAD} bytes")
            return -1
        if end - pos > MAX_HEAD:
            self._reject(431, f"request head larger than {MAX_HEAD} bytes")
            return -1
        self._head_scanned = 0
        if src[pos:end] == wire.H2_PREFACE_LINE:
            self._refuse_http2()
            return -1
        try:
            head = parse_request_head(bytes(src[pos:end]))
        except BadRequest as exc:
            self._reject(exc.status, str(exc))
            return -1
        pos = end + 4
        cfg = self.proxy.config
        self.phase, self.since = BODY, self.proxy.now()
        self._body_since = self.since
        if head.length > cfg.max_body_bytes:
            self._refuse(head, 413, head.length, max(0, head.length - (len(src) - pos)))
            return -1
        if head.length > 0 and not self.proxy.body_budget.fits(head.length):  # refused before it is sent
            self._refuse(head, 503, None, max(0, head.length - (len(src) - pos)))
            return -1
        self._head = head
        if head.length < 0:
            self._chunks = ChunkedBody(cfg.max_body_bytes)
        if (
            head.headers.get(b"expect", b"").lower() == b"100-continue"
            and head.version == b"HTTP/1.1"  # RFC 9110: never a 1xx to an HTTP/1.0 client
            and (head.length < 0 or len(src) - pos < head.length)
        ):
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return pos

    def _body_bytes(self, src: bytes | bytearray, pos: int) -> int:
        """Feed body bytes from ``src`` at ``pos`` to the current request; returns the position after them."""
        head = self._head
        assert head is not None
        chunks = self._chunks
        n = len(src)
        if chunks is None:
            take = min(head.length - self._have, n - pos)
            # the budget is taken as bytes arrive, not as declared: a length alone never holds any of it
            if take and not self._hold(take):
                self._refuse(head, 503, None, max(0, head.length - self._have - (n - pos)))
                return n
            if take:
                self._parts.append(src if take == n and type(src) is bytes else bytes(src[pos : pos + take]))
                self._have += take
            return pos + take
        try:
            end = chunks.feed(src, pos)
        except BadRequest as exc:
            if exc.status == 413:  # answered and captured like an over-limit content-length body
                self._refuse(head, 413, f"more than {self.proxy.config.max_body_bytes}", 1 << 62)
            else:
                self._reject(exc.status, str(exc))
            return n
        if chunks.size > self._held and not self._hold(chunks.size - self._held):
            self._refuse(head, 503, None, 1 << 62)
            return n
        return end

    def _body_done(self) -> bool:
        head = self._head
        assert head is not None
        return self._chunks.done if self._chunks is not None else self._have >= head.length

    def _dispatch_body(self) -> None:
        head = self._head
        assert head is not None
        if self._chunks is not None:
            body = self._chunks.body()
        else:
            body = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        self._head, self._chunks, self._parts, self._have = None, None, [], 0
        self._dispatch(self._request(head, body))

    def _hold(self, n: int) -> bool:
        """Reserve ``n`` bytes of the proxy's budget for bodies being received."""
        if not self.proxy.body_budget.take(n):
            return False
        self._held += n
        return True

    def _release(self) -> None:
        if self._held:
            self.proxy.body_budget.give(self._held)
            self._held = 0

    def _reject(self, status: int, message: str) -> None:
        """A request that cannot be framed: answer and close, never reading past it."""
        self.write(wire.error_response(status, message, anthropic=None, keep_alive=False))
        self._dropped = True
        self.close()

    def _refuse(self, head: Head, status: int, size: object, discard: int) -> None:
        """A framed request whose body the proxy will not take (413 too large, 503 over the body budget): the
        handler answers it and captures it; the rest of its body is read and dropped, then the connection
        closes."""
        self._release()
        self._head, self._chunks, self._parts, self._have = None, None, [], 0
        self._dropped = True
        self._discard = discard
        req = self._request(head, b"")
        req.keep_alive = False
        if status == 413:
            req.extra["too_large"] = size
        else:
            req.extra["over_budget"] = True
        self._dispatch(req)

    def _refuse_connection(self) -> None:
        """Over the connection limit: a 503 saying so, then a graceful close (the request is not read)."""
        limit = self.proxy.config.max_connections
        msg = (
            f"the proxy is at its limit of {limit} open connections; retry shortly, close idle connections, "
            "or start the proxy with a larger --max-connections (and ulimit -n)"
        )
        self._answer_and_leave(wire.error_response(503, msg, anthropic=None, keep_alive=False))

    def _refuse_http2(self) -> None:
        """An HTTP/2 client with prior knowledge: it reads HTTP/2 frames only, so an HTTP/1.1 error would reach
        it as a protocol error (or a broken pipe). It is told in its own framing, then the connection closes."""
        self._dropped = True
        msg = (
            "the clawpipe proxy speaks HTTP/1.1 only: send the request over HTTP/1.1 "
            "(drop --http2-prior-knowledge or the client's HTTP/2-only setting)"
        )
        self._answer_and_leave(wire.h2_refusal(msg))

    def _answer_and_leave(self, data: bytes) -> None:
        """Send ``data``, then close gracefully: further input is dropped unread, the client's own close ends
        the connection (closing with its input unread would reset it, and the client might lose the answer)."""
        self.refused = True
        self.phase = BUSY  # answered: the sweep's head timeout must not write after the end of output
        assert self.transport is not None
        self.transport.write(data)
        with contextlib.suppress(OSError, RuntimeError):
            self.transport.write_eof()
        self.proxy.call_later(2.0, self.transport.abort)

    @staticmethod
    def _request(head: Head, body: bytes) -> wire.Request:
        path, _, query = head.target.partition("?")
        keep = head.version == b"HTTP/1.1"
        conn_h = head.headers.get(b"connection")
        if conn_h is not None:
            low = conn_h.lower()
            if b"close" in low:
                keep = False
            elif b"keep-alive" in low:
                keep = True
        return wire.Request(head.method, head.target, path, query, head.version, head.headers, body, keep)

    def _dispatch(self, req: wire.Request) -> None:
        self.busy = True
        self._bodiless = 1 if req.method == "HEAD" else 0
        self.phase = BUSY
        self._release()  # the body is complete: the budget covers bodies still being received
        self.proxy.serve(self, req)

    def finish(self, keep_alive: bool) -> None:
        """The current request is answered: go on with the next one, or close."""
        self.busy = False
        self.call = None
        self._bodiless = 0
        self.phase, self.since = IDLE, self.proxy.now()
        if not keep_alive:
            if self._discard and not self.closed:  # closing with unread input would reset the connection
                self._close_pending = True
                self.proxy.call_later(30, self.close)
            else:
                self.close()
            return
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()
        if self.buf and not self.closed:
            self.phase = HEAD
            self._parse(None)
