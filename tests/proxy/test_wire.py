"""Framing parsers under arbitrary read splits (hypothesis): upstream responses and chunked request bodies."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from clawpipe.proxy.framing import ChunkedBody
from clawpipe.proxy.routes import prepare_body
from clawpipe.proxy.upstream import Replica, UpstreamConn


class _Sink:
    def __init__(self) -> None:
        self.status = 0
        self.body = b""
        self.ends = 0
        self.fails: list[BaseException] = []

    def up_head(self, status, headers) -> None:
        self.status = status

    def up_body(self, data: bytes) -> None:
        self.body += data

    def up_end(self) -> None:
        self.ends += 1

    def up_fail(self, exc, got_bytes) -> None:
        self.fails.append(exc)


class _Transport:
    def write(self, data: bytes) -> None:
        pass

    def abort(self) -> None:
        pass


def _chunked(body: bytes, sizes: list[int]) -> bytes:
    out, pos = [], 0
    for n in sizes:
        if pos >= len(body):
            break
        piece = body[pos : pos + n]
        out.append(b"%x;ext=1\r\n%b\r\n" % (len(piece), piece))
        pos += n
    if pos < len(body):
        out.append(b"%x\r\n%b\r\n" % (len(body) - pos, body[pos:]))
    return b"".join(out) + b"0\r\n\r\n"


def _feed(raw: bytes, cuts: list[int]) -> tuple[_Sink, Replica, UpstreamConn]:
    loop = asyncio.new_event_loop()
    try:
        rep = Replica("http://127.0.0.1:9", loop)
        conn = UpstreamConn(rep)
        conn.connection_made(_Transport())  # type: ignore[arg-type]
        sink = _Sink()
        conn.send(b"", sink)
        pos = 0
        for c in sorted(set(cuts)):
            if 0 < c < len(raw):
                conn.data_received(raw[pos:c])
                pos = c
        conn.data_received(raw[pos:])
        return sink, rep, conn
    finally:
        loop.close()


@settings(max_examples=150, deadline=None)
@given(
    body=st.binary(min_size=0, max_size=300),
    sizes=st.lists(st.integers(1, 40), max_size=20),
    cuts=st.lists(st.integers(0, 2000), max_size=12),
)
def test_chunked_upstream_response_survives_any_split(body: bytes, sizes: list[int], cuts: list[int]):
    raw = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + _chunked(body, sizes)
    sink, rep, conn = _feed(raw, cuts)
    assert (sink.status, sink.body, sink.ends, sink.fails) == (200, body, 1, [])
    assert rep.idle == [conn]  # clean end with keep-alive: back in the pool


@settings(max_examples=100, deadline=None)
@given(body=st.binary(min_size=0, max_size=300), cuts=st.lists(st.integers(0, 500), max_size=8))
def test_content_length_upstream_response_survives_any_split(body: bytes, cuts: list[int]):
    raw = b"HTTP/1.1 404 Not Found\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    sink, rep, _ = _feed(raw, cuts)
    assert (sink.status, sink.body, sink.ends) == (404, body, 1)
    assert len(rep.idle) == 1


def test_connection_close_response_is_not_pooled():
    sink, rep, _ = _feed(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok", [])
    assert sink.body == b"ok" and sink.ends == 1 and rep.idle == []


@settings(max_examples=100, deadline=None)
@given(
    body=st.binary(max_size=200), sizes=st.lists(st.integers(1, 30), max_size=10), cuts=st.lists(st.integers(0, 400))
)
def test_chunked_request_body_survives_any_split(body: bytes, sizes: list[int], cuts: list[int]):
    """Fed read by read (unconsumed bytes handed back first, as the connection does), the decoder stops exactly
    at the body's end and yields the body."""
    raw = _chunked(body, sizes) + b"NEXT"
    dec = ChunkedBody(10_000)
    pending = b""
    prev = 0
    for cut in [*sorted(c for c in cuts if c < len(raw)), len(raw)]:
        pending += raw[prev:cut]
        prev = cut
        pending = pending[dec.feed(pending) :]
        if dec.done:
            break
    assert dec.done and dec.body() == body and pending + raw[prev:] == b"NEXT"


def test_prepare_body_splices_or_rewrites():
    body = b' {"model": "m", "messages": []}'
    out, changes = prepare_body("chat", body, {"model": "m", "messages": []})
    import json

    assert json.loads(out) == {"model": "m", "messages": [], "return_token_ids": True, "logprobs": True}
    assert changes == {"added": {"return_token_ids": True, "logprobs": True}}
    out, changes = prepare_body(
        "chat", b'{"logprobs": false, "return_token_ids": true}', {"logprobs": False, "return_token_ids": True}
    )
    assert json.loads(out) == {"logprobs": True, "return_token_ids": True}
    assert changes == {"changed": {"logprobs": [False, True]}}
    assert prepare_body("messages", b"{}", {}) == (b'{"return_token_ids": true}', {"added": {"return_token_ids": True}})
    same = b'{"return_token_ids": true}'
    assert prepare_body("responses", same, {"return_token_ids": True}) == (same, {})


class _Proxy:
    """A ConnOwner (what a ClientConn needs of its proxy) that records the requests it is handed."""

    def __init__(self) -> None:
        from clawpipe.proxy import ProxyConfig
        from clawpipe.proxy.limits import BodyBudget

        self.config = ProxyConfig(upstreams=["http://127.0.0.1:1"], capture_dir="unused")
        self.body_budget = BodyBudget(1 << 20)
        self.conns: set[object] = set()
        self.seen: list[object] = []

    def now(self) -> float:
        return 0.0

    def call_later(self, delay: float, fn: object) -> None:
        pass

    def admit(self, conn: object) -> bool:
        self.conns.add(conn)
        return True

    def forget(self, conn: object) -> None:
        self.conns.discard(conn)

    def serve(self, conn: object, req: object) -> None:
        self.seen.append(req)


class _ClientTransport:
    def __init__(self) -> None:
        self.out = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


@settings(max_examples=150, deadline=None)
@given(
    bodies=st.lists(st.tuples(st.binary(max_size=120), st.booleans()), min_size=1, max_size=4),
    sizes=st.lists(st.integers(1, 40), max_size=6),
    cuts=st.lists(st.integers(0, 2000), max_size=12),
)
def test_pipelined_requests_are_parsed_the_same_under_any_read_split(bodies, sizes, cuts):
    """Content-Length and chunked requests back to back, cut into reads anywhere: each is handed over once,
    in order, with its exact body, and the budget for bodies being received ends at zero."""
    from clawpipe.proxy.conn import ClientConn

    raw = b""
    for body, chunked in bodies:
        raw += b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        if chunked:
            raw += b"transfer-encoding: chunked\r\n\r\n" + _chunked(body, sizes)
        else:
            raw += b"content-length: %d\r\n\r\n" % len(body) + body
    proxy = _Proxy()
    conn = ClientConn(proxy)  # type: ignore[arg-type]
    transport = _ClientTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    prev = 0
    for cut in [*sorted(c for c in cuts if c < len(raw)), len(raw)]:
        if cut > prev:
            conn.data_received(raw[prev:cut])
        prev = cut
        while conn.busy:
            conn.finish(True)
    assert [r.body for r in proxy.seen] == [b for b, _ in bodies]  # type: ignore[attr-defined]
    assert transport.out == b"" and not transport.closed and not conn.buf
    assert proxy.body_budget.used == 0
