"""One forwarded model call: the sink an upstream connection reports to.

It streams SSE bytes to the harness as they arrive, except the piece holding the stream's end marker, which
it holds until the call's record is durable; it stops taking bytes past the proxy's response size limit.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from clawpipe.proxy import wire
from clawpipe.proxy.coding import codings
from clawpipe.proxy.upstream import UpstreamConn


class Client(Protocol):
    """The harness side of a call: where its response bytes go (a ClientConn)."""

    def write(self, data: bytes) -> None: ...


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


class Call:
    """One forwarded model call: the upstream's :class:`~clawpipe.proxy.upstream.Sink` and its outcome."""

    __slots__ = (
        "chunked",
        "client",
        "coding",
        "error",
        "fut",
        "held",
        "holding",
        "limit",
        "outcome",
        "parts",
        "resp_headers",
        "size",
        "status",
        "stream",
        "streaming",
        "tail",
        "up",
    )

    def __init__(
        self,
        client: Client,
        stream: bool,
        loop: asyncio.AbstractEventLoop,
        chunked: bool = True,
        limit: int = 1 << 62,
    ) -> None:
        self.client = client
        self.limit = limit  # response bytes the proxy takes from the upstream
        self.size = 0
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
        self.coding: list[str] = []  # the answer's content codings, undone before it is captured and sent
        self.outcome = ""  # end | fail | timeout | cancelled | shutdown | too_large
        self.error: str | None = None
        self.up: UpstreamConn | None = None

    def _resolve(self, outcome: str, error: str | None = None) -> None:
        if not self.fut.done():
            self.outcome, self.error = outcome, error
            self.fut.set_result(None)

    # --- Sink ----------------------------------------------------------------------------------------
    def up_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.coding = codings(next((v for n, v in headers if n == b"content-encoding"), None))
        drop = wire.HOP_BY_HOP | {b"content-encoding"} if self.coding else wire.HOP_BY_HOP
        self.resp_headers = [(n, v) for n, v in headers if n not in drop]
        # a coded stream is not relayed as it comes: it is decoded whole (clawpipe.proxy.coding), then sent
        if self.stream and status == 200 and not self.coding:
            self.streaming = True
            self.client.write(wire.response_head(200, self.resp_headers, length=None if self.chunked else -1))

    def up_body(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:  # the piece that crosses the limit is dropped: parts stay under it
            up, self.up = self.up, None
            if up is not None:
                up.detach()
            self._resolve("too_large", f"upstream response larger than the proxy's limit of {self.limit} bytes")
            return
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
