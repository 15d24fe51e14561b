"""Server-Sent Events as the four APIs use them: framing for writers, an incremental reader for readers.

The reader follows the event-stream grammar of the HTML standard: lines end in LF, CRLF or CR; a line
starting with ``:`` is a comment; ``event:`` names the event; several ``data:`` lines of one event are
joined with LF; a blank line ends the event; one space after the colon is dropped. Bytes may arrive cut
anywhere (mid-line, mid-CRLF, mid-UTF-8 character): the reader keeps the unfinished tail for the next feed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class SSEEvent:
    data: bytes
    event: str | None = None


def sse_frame(data: Any, event: str | None = None) -> bytes:
    """One event carrying ``data`` as JSON (``event:`` line first when named, as Anthropic and Responses do)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


class SSEReader:
    """Feed bytes as they arrive; each :meth:`feed` returns the events completed by them."""

    def __init__(self) -> None:
        self._tail = b""  # bytes after the last complete line
        self._data: list[bytes] = []
        self._event: str | None = None
        self._has_data = False

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        buf = self._tail + chunk
        out: list[SSEEvent] = []
        start = 0
        n = len(buf)
        while start < n:
            cr, lf = buf.find(b"\r", start), buf.find(b"\n", start)
            if cr < 0 and lf < 0:
                break
            if cr >= 0 and (lf < 0 or cr < lf):
                if cr == n - 1:
                    break  # a CR that may be the first half of a CRLF: wait for the next byte
                end, nxt = cr, cr + 2 if buf[cr + 1 : cr + 2] == b"\n" else cr + 1
            else:
                end, nxt = lf, lf + 1
            self._line(buf[start:end], out)
            start = nxt
        self._tail = buf[start:]
        return out

    def close(self) -> list[SSEEvent]:
        """Events still open at the end of the stream: an unterminated last line and event count (a stream
        cut mid-event keeps what arrived; the caller decides whether a torn payload is usable)."""
        out: list[SSEEvent] = []
        if self._tail:
            self._line(self._tail.rstrip(b"\r"), out)
            self._tail = b""
        self._dispatch(out)
        return out

    def _line(self, line: bytes, out: list[SSEEvent]) -> None:
        if not line:
            self._dispatch(out)
            return
        if line[:1] == b":":
            return  # comment (keep-alive pings)
        name, colon, value = line.partition(b":")
        if colon and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data.append(value)
            self._has_data = True
        elif name == b"event":
            self._event = value.decode("utf-8", "replace")
        # id, retry and unknown fields carry nothing these APIs use

    def _dispatch(self, out: list[SSEEvent]) -> None:
        if self._has_data:
            data = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
            out.append(SSEEvent(data, self._event))
        self._data, self._event, self._has_data = [], None, False


def read_events(body: bytes) -> list[SSEEvent]:
    """Every event of a complete SSE body, in order (an unterminated last event included)."""
    reader = SSEReader()
    return reader.feed(body) + reader.close()


def json_events(body: bytes) -> list[dict[str, Any]]:
    """The JSON objects a complete SSE body carries, in order: what :func:`clawpipe.apis.reassemble` takes.

    The ``[DONE]`` marker and payloads that are not a JSON object (a torn last event, or one nested too deep
    to parse) are left out.
    """
    events = []
    for ev in read_events(body):
        if ev.data.strip() == b"[DONE]":
            continue
        try:
            obj = json.loads(ev.data)
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict):
            events.append(obj)
    return events
