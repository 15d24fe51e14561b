"""HTTP/1.1 pipelining with streams: several requests written at once on one connection, streamed and not,
framed by Content-Length and chunked (with a trailer), are answered in order, each in its own framing, and each
captured once; a client that leaves during the first answer has it captured as cancelled and the requests
behind it are neither forwarded nor captured; an empty line between requests is skipped."""

from __future__ import annotations

import json
import socket
import time

from clawpipe.proxy.framing import ChunkedBody
from tests.proxy.conftest import ProxyHandle, key_for
from tests.support.upstream import ScriptedUpstream, say


def _request(rollout: str, stream: bool, *, chunked: bool = False, close: bool = False) -> bytes:
    body = json.dumps({"model": "m", "stream": stream, "messages": [{"role": "user", "content": rollout}]}).encode()
    head = f"POST /r/{key_for(rollout)}/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    if close:
        head += "connection: close\r\n"
    if chunked:
        half = len(body) // 2
        chunks = b"%x\r\n%b\r\n%x\r\n%b\r\n" % (half, body[:half], len(body) - half, body[half:])
        return (head + "transfer-encoding: chunked\r\n\r\n").encode() + chunks + b"0\r\nx-trailer: 1\r\n\r\n"
    return (head + f"content-length: {len(body)}\r\n\r\n").encode() + body


def _answers(data: bytes) -> list[tuple[bytes, bytes]]:
    """(status line, body) of each response in ``data``: Content-Length or chunked framing."""
    out = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        fields = {n.lower(): v for n, _, v in (ln.partition(b": ") for ln in lines[1:])}
        if b"content-length" in fields:
            n = int(fields[b"content-length"])
            body, data = data[:n], data[n:]
        else:
            assert fields.get(b"transfer-encoding") == b"chunked", head
            chunks = ChunkedBody(1 << 30)
            used = chunks.feed(data)
            assert chunks.done
            body, data = chunks.body(), data[used:]
        out.append((lines[0], body))
    return out


def _text(body: bytes) -> str:
    """The answer's text, from a whole chat completion or from its stream's events."""
    if body.startswith(b"{"):
        return str(json.loads(body)["choices"][0]["message"]["content"])
    events = [ln[6:] for ln in body.split(b"\n") if ln.startswith(b"data: ") and ln != b"data: [DONE]"]
    return "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events)


def _connect(proxy: ProxyHandle) -> socket.socket:
    host, port = proxy.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_pipelined_streamed_and_plain_calls_are_answered_in_order_and_captured_once(
    proxy: ProxyHandle, upstream: ScriptedUpstream
):
    upstream.push(*(say(f"answer {i}") for i in range(5)))
    plan = [("p0", True, False), ("p1", False, False), ("p2", True, True), ("p3", False, True), ("p4", True, False)]
    data = b"".join(_request(r, s, chunked=c, close=r == "p4") for r, s, c in plan)
    with _connect(proxy) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):  # the last request asked the proxy to close
            out += chunk
    answers = _answers(out)
    assert [status for status, _ in answers] == [b"HTTP/1.1 200 OK"] * 5
    assert [_text(body) for _, body in answers] == [f"answer {i}" for i in range(5)]
    records = proxy.records()
    assert [r.header["rollout_id"] for r in records] == ["p0", "p1", "p2", "p3", "p4"]
    assert [r.header["stream"] for r in records] == [s for _, s, _ in plan]
    assert {r.header["status"] for r in records} == {"ok"}
    assert [json.loads(r.request)["messages"][0]["content"] for r in records] == ["p0", "p1", "p2", "p3", "p4"]


def test_a_client_leaving_during_the_first_of_its_pipelined_calls_has_only_that_one_captured(make_proxy):
    upstream = ScriptedUpstream(default=say("word " * 50), chunk_delay_s=0.02).start()
    try:
        proxy = make_proxy([upstream.url])
        with _connect(proxy) as s:
            s.sendall(_request("first", True) + _request("second", False) + _request("third", True))
            assert s.recv(65536).startswith(b"HTTP/1.1 200 OK")  # the first stream has begun
        deadline = time.monotonic() + 10
        while not proxy.records() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # time enough for a (wrong) forward of the requests behind it
        (rec,) = proxy.records()
        assert rec.header["rollout_id"] == "first" and rec.header["status"] == "cancelled"
        assert [json.loads(r.body)["messages"][0]["content"] for r in upstream.model_requests()] == ["first"]
    finally:
        upstream.stop()


def test_an_empty_line_after_a_body_is_ignored_and_the_next_request_served(
    proxy: ProxyHandle, upstream: ScriptedUpstream
):
    """RFC 9112 2.2: a server ignores empty lines before a request line. The CRLF some clients send after a
    body made the next request's line empty: a 400, and the connection closed."""
    with _connect(proxy) as s:
        s.sendall(_request("crlf1", False) + b"\r\n")
        time.sleep(0.2)  # the CRLF arrives alone, after the call
        s.sendall(b"\r\n" + _request("crlf2", True, chunked=True) + b"\r\n\r\n" + _request("crlf3", False, close=True))
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    assert [status for status, _ in _answers(out)] == [b"HTTP/1.1 200 OK"] * 3
    assert [r.header["rollout_id"] for r in proxy.records()] == ["crlf1", "crlf2", "crlf3"]
