"""Requests of unusual clients and of attackers at the proxy's HTTP boundary, over raw sockets: framing a peer
could read differently is refused before anything is forwarded, bodies the proxy would read differently
from the upstream or the lake are a captured 400, and odd but valid requests get well-formed answers."""

from __future__ import annotations

import gzip
import socket
import time
import tracemalloc

import httpx
import pytest

from tests.proxy.conftest import ADMIN, ProxyHandle, key_for
from tests.proxy.test_framing import CHAT, _assert_refused, _exchange, _head, _smuggled
from tests.support.upstream import ScriptedUpstream


@pytest.mark.parametrize("length", [False, True])
@pytest.mark.parametrize("value", ["", ",", " , ,"])
def test_an_empty_transfer_encoding_is_400_and_nothing_is_smuggled(proxy: ProxyHandle, upstream, value, length):
    """An empty Transfer-Encoding names no coding: the proxy framed the body by Content-Length (or as none)
    where a peer that sees the header takes it as chunked."""
    if length:
        data = _head("te-cl", f"transfer-encoding: {value}", f"content-length: {len(CHAT)}") + CHAT
    else:
        data = _head("te-empty", f"transfer-encoding: {value}") + b"%x\r\n%b\r\n0\r\n\r\n" % (len(CHAT), CHAT)
    out = _exchange(proxy, data + _smuggled())
    _assert_refused(out, 400, upstream, proxy)
    assert b"empty Transfer-Encoding" in out


def test_a_tab_in_the_request_target_is_400(proxy: ProxyHandle, upstream):
    """The target is forwarded as sent: a tab in it would split the upstream's request line differently."""
    data = _head("tab").replace(b"/chat/completions ", b"/chat/completions?a=1\tHTTP/1.0 ", 1)
    out = _exchange(proxy, data.removesuffix(b"\r\n") + b"content-length: %d\r\n\r\n" % len(CHAT) + CHAT)
    _assert_refused(out, 400, upstream, proxy)
    assert b"request target" in out


@pytest.mark.parametrize("line", [b"%x;a\nb", b"%x;a\x00", b"%x;a\rb", b"%x\x0b"])
def test_a_control_character_in_a_chunk_size_line_is_400(proxy: ProxyHandle, upstream, line: bytes):
    body = line % len(CHAT) + b"\r\n" + CHAT + b"\r\n0\r\n\r\n"
    out = _exchange(proxy, _head("chunk-ctl", "transfer-encoding: chunked") + body + _smuggled())
    _assert_refused(out, 400, upstream, proxy)
    assert b"control character" in out


def test_a_head_request_gets_a_head_without_content_and_the_connection_goes_on(proxy: ProxyHandle, upstream):
    """The 405 to a HEAD (/v1/models is served to GET) carries no body: a keep-alive client would read those
    bytes as its next answer."""
    key = key_for("head")
    head_req = f"HEAD /r/{key}/v1/models HTTP/1.1\r\nhost: x\r\n\r\n".encode()
    post = _head("after-head", f"content-length: {len(CHAT)}", "connection: close") + CHAT
    out = _exchange(proxy, head_req + post)
    first, _, rest = out.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 405") and b"content-length: " in first and b"allow: GET" in first
    assert rest.startswith(b"HTTP/1.1 200"), rest[:80]
    assert rest.count(b"HTTP/1.1 ") == 1
    statuses = sorted((r.header["rollout_id"], r.header["http_status"]) for r in proxy.records())
    assert statuses == [("after-head", 200), ("head", 405)]
    unauthorized = _exchange(proxy, b"HEAD /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert unauthorized.startswith(b"HTTP/1.1 401") and unauthorized.endswith(b"\r\n\r\n")


def test_no_100_continue_to_an_http_1_0_client(proxy: ProxyHandle, upstream):
    host, port = proxy.url.removeprefix("http://").split(":")
    head = f"POST /r/{key_for('old')}/v1/chat/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
    head += f"expect: 100-continue\r\ncontent-length: {len(CHAT)}\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(head.encode())
        time.sleep(0.3)  # a 1.1 client would have its 100 Continue by now
        s.sendall(CHAT)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    assert out.startswith(b"HTTP/1.1 200"), out[:80]
    (rec,) = proxy.records()
    assert rec.header["http_status"] == 200


_TEXT = '{"model": "m", "messages": [{"role": "user", "content": "x"}]}'


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"\xef\xbb\xbf" + _TEXT.encode(), "byte order mark"),
        (_TEXT.encode("utf-16-le"), "not valid JSON"),  # reads as UTF-8 with NULs: not JSON
        (_TEXT.encode("utf-16"), "not UTF-8"),
        (_TEXT.encode("utf-32-be"), "not valid JSON"),
        (_TEXT.replace('"x"', '"\xed\xa0\x80"').encode("latin-1"), "not UTF-8"),  # an encoded surrogate
        (b'{"model": "m", "temperature": NaN, "messages": []}', "NaN is not a JSON value"),
        (b'{"model": "m", "max_tokens": Infinity, "messages": []}', "Infinity is not a JSON value"),
        (b'{"model": "m", "temperature": -Infinity, "logprobs": false, "messages": []}', "-Infinity"),
        (b'{"model": "m", "temperature": 1e999, "logprobs": false, "messages": []}', "1e999 is out of range"),
    ],
    ids=["bom", "utf16le", "utf16", "utf32", "surrogate", "nan", "infinity", "minus-infinity", "overflow"],
)
def test_a_body_that_is_not_utf8_json_is_a_captured_400(
    proxy: ProxyHandle, upstream: ScriptedUpstream, body: bytes, says: str
):
    """The proxy reads the body to splice in its fields: it must read it as the upstream and the lake do."""
    r = httpx.post(f"{proxy.openai_base('enc')}/chat/completions", content=body, timeout=10)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    assert upstream.requests == []
    (rec,) = proxy.records()
    assert rec.header["http_status"] == 400 and rec.request == body


@pytest.mark.parametrize("value", ["1", '"true"', '"false"', "0", "{}", "[" * 950 + "]" * 950])
def test_a_stream_flag_that_is_not_a_boolean_is_a_captured_400(proxy: ProxyHandle, upstream, value: str):
    """An upstream that coerces 1 or "true" would stream an answer the proxy takes (and captures) as whole."""
    body = b'{"model": "m", "stream": %b, "messages": [{"role": "user", "content": "x"}]}' % value.encode()
    r = httpx.post(f"{proxy.openai_base('flag')}/chat/completions", content=body, timeout=10)
    assert r.status_code == 400 and "stream must be true or false" in r.json()["error"]["message"], r.text
    assert upstream.requests == []
    (rec,) = proxy.records()
    assert rec.header["http_status"] == 400 and rec.header["stream"] is False
    plain = b'{"model": "m", "stream": null, "messages": [{"role": "user", "content": "x"}]}'
    assert httpx.post(f"{proxy.openai_base('null')}/chat/completions", content=plain, timeout=10).status_code == 200


def test_an_absolute_form_target_is_served_from_the_configured_upstream(proxy: ProxyHandle, upstream):
    """RFC 9112 has servers accept ``POST http://host/path``, which clients configured to use the proxy as
    a forward proxy send: the path is served as usual, and the host it names is never contacted."""
    target = f"http://evil.invalid:81/r/{key_for('absolute')}/v1/chat/completions?x=1"
    data = _head("absolute", f"content-length: {len(CHAT)}", "connection: close").replace(
        f"/r/{key_for('absolute')}/v1/chat/completions".encode(), target.encode(), 1
    )
    out = _exchange(proxy, data + CHAT)
    assert out.startswith(b"HTTP/1.1 200"), out[:200]
    (seen,) = upstream.requests
    assert seen.path == "/v1/chat/completions" and seen.query == "x=1"
    assert seen.headers["host"] == upstream.url.removeprefix("http://")
    (rec,) = proxy.records()
    assert rec.header["rollout_id"] == "absolute" and rec.header["path"] == "/v1/chat/completions"
    assert rec.header["query"] == "x=1"


@pytest.mark.parametrize("path", ["/admin/pause", "/admin/replicas/drain"])
def test_a_deeply_nested_admin_body_is_400(proxy: ProxyHandle, path: str):
    deep = b"[" * 100_000 + b"]" * 100_000
    r = httpx.post(f"{proxy.url}{path}", content=deep, headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"], r.text
    assert not proxy.server.paused


def test_a_body_of_one_byte_chunks_costs_memory_in_proportion_to_its_size(proxy: ProxyHandle, upstream):
    """100,000 chunks of one byte each: the proxy holds the body, not an object per chunk (a budget of N
    bytes must not become 100 N bytes of memory). The body is not JSON, so only the proxy handles it."""
    content = b"x" * 100_000
    body = b"1\r\nx\r\n" * len(content) + b"0\r\n\r\n"
    data = _head("tiny-chunks", "transfer-encoding: chunked", "connection: close") + body
    tracemalloc.start()
    try:
        out = _exchange(proxy, data, timeout=60)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.startswith(b"HTTP/1.1 400") and b"not valid JSON" in out, out[:200]
    (rec,) = proxy.records()
    assert rec.request == content and upstream.requests == []
    assert peak < 10 * len(content), f"peak {peak >> 20} MiB for a {len(content) >> 10} KiB body"


def test_a_compressed_request_body_is_a_captured_415(proxy: ProxyHandle, upstream):
    packed = gzip.compress(CHAT)
    r = httpx.post(
        f"{proxy.openai_base('gz')}/chat/completions", content=packed, headers={"content-encoding": "gzip"}, timeout=10
    )
    assert r.status_code == 415 and "send the body uncompressed" in r.json()["error"]["message"], r.text
    assert upstream.requests == []
    (rec,) = proxy.records()
    assert rec.header["http_status"] == 415 and rec.request == packed
    plain = httpx.post(
        f"{proxy.openai_base('id')}/chat/completions",
        content=CHAT,
        headers={"content-encoding": "identity"},
        timeout=10,
    )
    assert plain.status_code == 200


def test_calls_in_flight_do_not_keep_their_parsed_bodies(proxy: ProxyHandle, upstream: ScriptedUpstream):
    """A JSON body parses to many times its size (here 200,000 empty objects: ~15 MB from 600 KB), and a call
    may wait minutes for its answer: five calls held by the upstream keep their bodies, not the parsed ones."""
    upstream.hang = True
    filler = b"[" + b"{}," * 200_000 + b"{}]"
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "metadata": ' + filler + b"}"
    head = _head("held", f"content-length: {len(body)}")
    host, port = proxy.url.removeprefix("http://").split(":")
    socks = []
    tracemalloc.start()
    try:
        for _ in range(5):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(head + body)
            socks.append(s)
        deadline = time.monotonic() + 30
        while len(upstream.requests) < 5:
            assert time.monotonic() < deadline, "calls not forwarded"
            time.sleep(0.05)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        for s in socks:
            s.close()
    assert held < 5 * 8 * len(body), f"{held >> 20} MiB held by 5 calls of {len(body) >> 10} KiB"
    deadline = time.monotonic() + 10
    while len(proxy.records()) < 5:  # the calls the clients gave up on are captured as cancelled
        assert time.monotonic() < deadline, "cancelled calls not captured"
        time.sleep(0.05)
    assert {r.header["status"] for r in proxy.records()} == {"cancelled"}
