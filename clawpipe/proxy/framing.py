"""HTTP/1.1 message framing of the proxy (RFC 9112), strict on both sides of it.

Request heads: CRLF line endings only, no control characters but HTAB, field names are tokens (no space
before the colon, no obsolete line folding), one body length: ``Content-Length`` (duplicates must agree) or
``Transfer-Encoding`` ending in ``chunked``, never both; ``Authorization`` and ``x-api-key`` (the rollout key)
at most once each, or repeated with the same value. Anything else is answered with an error and the
connection closed, so bytes after an ambiguous request are never parsed as another request (smuggling).
:func:`check_response_head` applies the same rules to an upstream's response heads.

:class:`ChunkedBody` decodes a chunked body incrementally: each read continues where the last one stopped,
so a body costs time linear in its size whatever the read sizes (``scanned`` counts the bytes it examined).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from clawpipe.proxy.wire import BadRequest, chunk_size

MAX_HEAD = 65536  # request head (and upstream response head) size limit
MAX_CHUNK_LINE = 4096  # a chunk-size line with its extensions
# A bare CR or LF (not part of a CRLF) or a control character other than HTAB.
_BAD_HEAD = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\r(?!\n)|(?<!\r)\n")
# Fast paths of the same checks (bytes.translate deletes in C): what is left after deleting the allowed bytes.
_HEAD_OK = bytes([9, 10, 13, *range(0x20, 0x7F), *range(0x80, 0x100)])
_TOKEN_OK = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_VERSIONS = (b"HTTP/1.1", b"HTTP/1.0")
# Fields that name a request's rollout: two of one name with different values would attribute the call to
# whichever came last, so they are refused instead (the same value repeated names one rollout).
_KEY_FIELDS = frozenset((b"authorization", b"x-api-key"))


@dataclass(slots=True)
class Head:
    """A parsed request head. ``length`` is the body's Content-Length, or -1 for a chunked body."""

    method: str
    target: str
    version: bytes
    headers: dict[bytes, bytes]
    length: int


_BAD_NAMES = {b"\n": "a bare LF", b"\r": "a bare CR"}


def _lines(head: bytes, what: str) -> list[bytes]:
    crlf = head.count(b"\r\n")
    if head.translate(None, _HEAD_OK) or head.count(b"\r") != crlf or head.count(b"\n") != crlf:
        bad = _BAD_HEAD.search(head)
        assert bad is not None
        found = _BAD_NAMES.get(bad.group()[:1], "a control character")
        raise BadRequest(
            400,
            f"{what} head has {found} at byte {bad.start()}: end every line with CRLF and send no control "
            "characters but tab",
        )
    return head.split(b"\r\n")


def _fields(
    lines: list[bytes], what: str, ordered: list[tuple[bytes, bytes]] | None = None
) -> tuple[dict[bytes, bytes], set[int], list[bytes]]:
    """Header fields by lower-cased name (last value wins; also in order into ``ordered`` when given), the
    Content-Length values, the transfer codings."""
    headers: dict[bytes, bytes] = {}
    lengths: set[int] = set()
    codings: list[bytes] = []
    for line in lines:
        name, sep, value = line.partition(b":")
        if not sep or not name or name.translate(None, _TOKEN_OK):
            raise BadRequest(400, f"malformed {what} header line {line[:60]!r}: expected 'Name: value'")
        lname = name.lower()
        value = value.strip(b" \t")
        if len(lname) not in (14, 17):  # neither content-length nor transfer-encoding
            if lname in _KEY_FIELDS and headers.get(lname, value) != value:
                raise BadRequest(
                    400, f"more than one {lname.decode()} header, with different values: send one key per request"
                )
            headers[lname] = value
            if ordered is not None:
                ordered.append((lname, value))
            continue
        if lname == b"content-length":
            items = [value] if value.isdigit() else [i.strip(b" \t") for i in value.split(b",")]
            for item in items:
                if not item.isdigit() or len(item) > 18:
                    raise BadRequest(400, f"malformed Content-Length {value[:40]!r} in the {what}")
                lengths.add(int(item))
        elif lname == b"transfer-encoding":
            named = [c.strip(b" \t").lower() for c in value.split(b",") if c.strip(b" \t")]
            if not named:  # else the body would be framed by Content-Length, or none, where a peer sees chunked
                raise BadRequest(
                    400, f"empty Transfer-Encoding in the {what}: send Transfer-Encoding: chunked or Content-Length"
                )
            codings.extend(named)
            value = b", ".join(codings)
        headers[lname] = value
        if ordered is not None:
            ordered.append((lname, value))
    return headers, lengths, codings


def parse_request_head(head: bytes) -> Head:
    """Parse and check a request head (without its final CRLFCRLF); raises :class:`BadRequest` (400/501)."""
    lines = _lines(head, "request")
    parts = lines[0].split(b" ")
    if (
        len(parts) != 3
        or parts[2] not in _VERSIONS
        or not parts[0]
        or parts[0].translate(None, _TOKEN_OK)
        or not parts[1]
    ):
        raise BadRequest(400, "malformed HTTP request line: expected 'METHOD /path HTTP/1.1'")
    if not parts[1].isascii():
        raise BadRequest(400, "non-ASCII request target: percent-encode it")
    if b"\t" in parts[1]:  # forwarded as is: a tab splits the request line for parsers that split on whitespace
        raise BadRequest(400, "a tab in the request target: percent-encode it (%09)")
    headers, lengths, codings = _fields(lines[1:], "request")
    target = _origin_form(parts[1].decode())
    version = parts[2]
    if codings:
        if lengths:
            raise BadRequest(400, "the request has both Content-Length and Transfer-Encoding: send only one")
        if version == b"HTTP/1.0":
            raise BadRequest(400, "Transfer-Encoding is not allowed in an HTTP/1.0 request: send Content-Length")
        if codings[-1] != b"chunked" or codings.count(b"chunked") > 1:
            raise BadRequest(
                400,
                f"Transfer-Encoding {headers[b'transfer-encoding'][:60]!r} does not end in one chunked: the body "
                "length cannot be determined; send Content-Length or Transfer-Encoding: chunked",
            )
        if len(codings) > 1:  # a coding we would have to undo (RFC 9112: 501 for codings not understood)
            raise BadRequest(
                501,
                f"Transfer-Encoding {headers[b'transfer-encoding'][:60]!r} is not supported: "
                "send the body unencoded, with Content-Length or Transfer-Encoding: chunked alone",
            )
        length = -1
    elif len(lengths) > 1:
        raise BadRequest(400, f"conflicting Content-Length values {sorted(lengths)}: send one")
    else:
        length = lengths.pop() if lengths else 0
    return Head(parts[0].decode(), target, version, headers, length)


def _origin_form(target: str) -> str:
    """The path and query of an absolute-form target (``http://host/path?q``, which RFC 9112 has servers
    accept, as clients configured to use the proxy as a forward proxy send); any other target as it is.
    The host named is ignored: calls only ever go to the proxy's own upstreams."""
    scheme, sep, rest = target.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return target
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    path = rest[cut:]
    return path if path.startswith("/") else "/" + path


@dataclass(slots=True)
class ResponseFraming:
    """What an upstream response head says about its body."""

    status: int
    headers: list[tuple[bytes, bytes]]
    length: int  # -1: none given
    chunked: bool
    keep_alive: bool


def check_response_head(head: bytes) -> ResponseFraming:
    """Parse and check an upstream response head; raises ValueError saying what is wrong."""
    try:
        lines = _lines(head, "upstream response")
        status_line = lines[0].split(b" ", 2)
        if len(status_line) < 2 or status_line[0] not in _VERSIONS:
            raise BadRequest(502, f"malformed status line {lines[0][:80]!r}")
        if not (len(status_line[1]) == 3 and status_line[1].isdigit()):
            raise BadRequest(502, f"malformed status code {status_line[1][:10]!r}")
        ordered: list[tuple[bytes, bytes]] = []
        headers, lengths, codings = _fields(lines[1:], "upstream response", ordered)
    except BadRequest as exc:
        raise ValueError(str(exc)) from exc
    if codings and lengths:
        raise ValueError("it has both Content-Length and Transfer-Encoding")
    if codings and codings != [b"chunked"]:
        raise ValueError(f"unsupported Transfer-Encoding {headers[b'transfer-encoding'][:60]!r}")
    if len(lengths) > 1:
        raise ValueError(f"conflicting Content-Length values {sorted(lengths)}")
    keep_alive = status_line[0] != b"HTTP/1.0"
    conn = headers.get(b"connection", b"").lower()
    if b"close" in conn:
        keep_alive = False
    elif b"keep-alive" in conn:
        keep_alive = True
    return ResponseFraming(
        int(status_line[1]),
        ordered,
        lengths.pop() if lengths else -1,
        bool(codings),
        keep_alive,
    )


_SIZE, _DATA, _DATA_END, _TRAILER, _DONE = range(5)


class ChunkedBody:
    """Incremental decoder of one chunked request body.

    :meth:`feed` takes the connection's unconsumed bytes and returns how many it consumed; chunk data is kept
    in ``received`` (``size`` bytes so far: one buffer, so tiny chunks cost no object each), ``done`` is set after
    the last chunk and the trailer section.
    """

    __slots__ = ("_pending", "_searched", "_state", "_trailer", "done", "limit", "received", "scanned", "size")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.received = bytearray()
        self.size = 0
        self.scanned = 0  # bytes examined, for the linear-work check
        self.done = False
        self._state = _SIZE
        self._pending = 0  # bytes of the current chunk still to come
        self._trailer = 0  # trailer bytes so far
        self._searched = 0  # bytes of an incomplete line already searched for its CRLF

    def body(self) -> bytes:
        return bytes(self.received)

    def feed(self, data: bytes | bytearray, pos: int = 0) -> int:
        """Consume what can be consumed of ``data`` from ``pos`` on (what the last call left unconsumed comes
        first again); returns the position after it. Raises BadRequest (400 malformed, 413 over the limit)."""
        n = len(data)
        while pos < n and not self.done:
            state = self._state
            if state == _DATA:
                take = min(self._pending, n - pos)
                self.received += memoryview(data)[pos : pos + take]
                self.scanned += take
                pos += take
                self._pending -= take
                if not self._pending:
                    self._state = _DATA_END
            elif state == _DATA_END:
                if n - pos < 2:
                    break
                self.scanned += 2
                if data[pos : pos + 2] != b"\r\n":
                    raise BadRequest(400, "chunk data is not followed by CRLF: the chunk size is wrong")
                pos += 2
                self._state = _SIZE
            else:
                start = pos + max(0, self._searched - 1)  # an incomplete line is not searched again
                line_end = data.find(b"\r\n", start)
                self.scanned += (line_end if line_end >= 0 else n) - start
                if line_end < 0:
                    limit = MAX_CHUNK_LINE if state == _SIZE else MAX_HEAD - self._trailer
                    if n - pos > limit:
                        raise BadRequest(400, "chunk-size or trailer line too long")
                    self._searched = n - pos
                    break
                self._searched = 0
                line = data[pos:line_end]
                pos = line_end + 2
                if state == _SIZE:
                    self._size_line(bytes(line))
                elif not line:
                    self.done = True
                else:
                    self._trailer += len(line) + 2
                    if self._trailer > MAX_HEAD or _BAD_HEAD.search(line):
                        raise BadRequest(400, "malformed or oversized trailer section in the chunked body")
        return pos

    def _size_line(self, line: bytes) -> None:
        try:
            size = chunk_size(line)
        except ValueError as exc:
            raise BadRequest(400, f"malformed chunk size in the request body: {exc}") from exc
        if size == 0:
            self._state = _TRAILER
            return
        self.size += size
        if self.size > self.limit:
            raise BadRequest(413, f"request body exceeds the proxy limit of {self.limit} bytes")
        self._pending = size
        self._state = _DATA
