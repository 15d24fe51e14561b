"""RFC 9112 message framing at the proxy: ambiguous or malformed requests are refused and their connection
closed before anything reaches the upstream; malformed upstream responses end the call as a 502."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from clawpipe.proxy.framing import ChunkedBody
from tests.proxy.conftest import ProxyHandle, key_for
from tests.support.net import read_all
from tests.support.upstream import ScriptedUpstream

CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}'


def _exchange(proxy: ProxyHandle, data: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes and read everything until the proxy closes the connection (or the timeout)."""
    host, port = proxy.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        return read_all(s)


def _head(rollout: str, *lines: str) -> bytes:
    head = f"POST /r/{key_for(rollout)}/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    return (head + "".join(line + "\r\n" for line in lines) + "\r\n").encode()


def _smuggled() -> bytes:
    """A second complete request, to be hidden in the first one's body."""
    return _head("smuggled", f"content-length: {len(CHAT)}") + CHAT


def _assert_refused(out: bytes, status: int, upstream: ScriptedUpstream, proxy: ProxyHandle) -> None:
    assert out.startswith(b"HTTP/1.1 %d" % status), out[:200]
    assert out.count(b"HTTP/1.1 ") == 1  # one answer, then the connection closed: nothing after it was parsed
    assert b"connection: close" in out.lower()
    assert upstream.requests == []
    assert proxy.records() == []  # no key-attributed call was made of it
    ok = httpx.post(f"{proxy.openai_base('after')}/chat/completions", content=CHAT, timeout=10)
    assert ok.status_code == 200


def test_content_length_with_transfer_encoding_is_400_and_nothing_is_smuggled(proxy: ProxyHandle, upstream):
    body = b"0\r\n\r\n" + _smuggled()
    data = _head("cl-te", f"content-length: {len(body)}", "transfer-encoding: chunked") + body
    _assert_refused(_exchange(proxy, data), 400, upstream, proxy)


def test_transfer_encoding_with_content_length_after_it_is_400(proxy: ProxyHandle, upstream):
    smuggled = _smuggled()
    chunk = b"%x\r\n%b\r\n0\r\n\r\n" % (len(smuggled), smuggled)
    data = _head("te-cl", "transfer-encoding: chunked", "content-length: 4") + chunk
    _assert_refused(_exchange(proxy, data), 400, upstream, proxy)


@pytest.mark.parametrize(
    ("codings", "status"),
    [
        (["xchunked"], 400),
        (["chunked, gzip"], 400),
        (["identity"], 400),
        (["chunked", "chunked"], 400),  # chunked twice: two header lines combine
        (["gzip, chunked"], 501),  # chunked last, but a coding the proxy does not undo (RFC 9112: 501)
        (["gzip", "chunked"], 501),
    ],
)
def test_transfer_codings_other_than_chunked_are_refused(proxy: ProxyHandle, upstream, codings, status):
    body = b"%x\r\n%b\r\n0\r\n\r\n" % (len(CHAT), CHAT)
    data = _head("te", *(f"transfer-encoding: {c}" for c in codings)) + body + _smuggled()
    out = _exchange(proxy, data)
    _assert_refused(out, status, upstream, proxy)
    assert b"Transfer-Encoding" in out


def test_duplicate_content_lengths_must_agree(proxy: ProxyHandle, upstream):
    n = len(CHAT)
    out = _exchange(proxy, _head("dup", f"content-length: {n}", f"content-length: {n + 5}") + CHAT + b"12345")
    _assert_refused(out, 400, upstream, proxy)
    assert b"conflicting Content-Length" in out
    assert _exchange(proxy, _head("list", f"content-length: {n}, {n + 1}") + CHAT + b" ").startswith(b"HTTP/1.1 400")
    same = _head("same", f"content-length: {n}", f"Content-Length: {n}", "connection: close") + CHAT
    assert _exchange(proxy, same).startswith(b"HTTP/1.1 200")  # identical duplicates are one length


@pytest.mark.parametrize("size", [100_000, 1 << 20])
def test_the_head_limit_holds_within_one_read(proxy: ProxyHandle, upstream, size: int):
    """A head larger than 64 KB is refused whether or not its end arrived in the same read."""
    big = _head("big", "x-filler: " + "a" * size, f"content-length: {len(CHAT)}") + CHAT
    _assert_refused(_exchange(proxy, big), 431, upstream, proxy)
    endless = b"POST /v1/chat/completions HTTP/1.1\r\nx-filler: " + b"a" * size
    assert _exchange(proxy, endless).startswith(b"HTTP/1.1 431")


@pytest.mark.parametrize(
    "line",
    [
        b"x-bad: one\ncontent-length: 0",  # a bare LF splits lines for some servers, not for others
        b"x-bad: one\rtwo",
        b"x-bad: \x01",
        b"x-bad: a\x00b",
        b"x-bad: \x7f",
        b"x-bad : spaced",  # whitespace before the colon
        b"x-bad: one\r\n folded",  # obsolete line folding
    ],
)
def test_bare_lf_and_control_characters_in_the_head_are_400(proxy: ProxyHandle, upstream, line: bytes):
    head = _head("ctl").removesuffix(b"\r\n") + line + b"\r\ncontent-length: %d\r\n\r\n" % len(CHAT)
    out = _exchange(proxy, head + CHAT)
    _assert_refused(out, 400, upstream, proxy)


def test_a_tab_in_a_header_value_is_fine(proxy: ProxyHandle, upstream):
    out = _exchange(proxy, _head("tab", "x-ok: a\tb", f"content-length: {len(CHAT)}", "connection: close") + CHAT)
    assert out.startswith(b"HTTP/1.1 200")


def test_a_bare_lf_in_the_request_line_is_400(proxy: ProxyHandle, upstream):
    out = _exchange(proxy, b"POST /v1/chat/completions HTTP/1.1\nhost: x\r\n\r\n")
    _assert_refused(out, 400, upstream, proxy)


def test_chunk_data_must_end_with_crlf(proxy: ProxyHandle, upstream):
    body = b"%x\r\n%bXX0\r\n\r\n" % (len(CHAT), CHAT)  # a wrong size: the data runs into the next size line
    out = _exchange(proxy, _head("crlf", "transfer-encoding: chunked") + body)
    _assert_refused(out, 400, upstream, proxy)


def test_chunked_decoding_examines_each_byte_a_bounded_number_of_times():
    """The decoder continues where the last read stopped: bytes scanned stay linear in the body's size
    whatever the read sizes (re-decoding from the start on every read scanned ~n^2 / read bytes)."""
    body = b"x" * (4 << 20)
    chunked = b"".join(
        b"%x\r\n%b\r\n" % (len(body[i : i + 8192]), body[i : i + 8192]) for i in range(0, len(body), 8192)
    )
    chunked += b"0\r\n\r\n"
    for read in (1000, 65536):
        dec = ChunkedBody(len(body))
        pending = b""
        for i in range(0, len(chunked), read):
            pending += chunked[i : i + read]
            pending = pending[dec.feed(pending) :]
        assert dec.done and dec.body() == body
        assert dec.scanned <= 2 * len(chunked), (read, dec.scanned)


# --- upstream responses ---------------------------------------------------------------------------------------


@pytest.fixture
def raw_upstream() -> Iterator[Any]:
    """An upstream answering every request with the bytes in ``answer[0]``."""
    answer: list[bytes] = [b""]
    loop = asyncio.new_event_loop()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(answer[0])
        await writer.drain()
        await asyncio.sleep(2)
        writer.close()

    server = loop.run_until_complete(asyncio.start_server(serve, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield answer, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


OK_BODY = b'{"choices": []}'


@pytest.mark.parametrize(
    ("response", "reason"),
    [
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 15\r\ntransfer-encoding: chunked\r\n\r\nf\r\n"
            + OK_BODY
            + b"\r\n0\r\n\r\n",
            "both Content-Length and Transfer-Encoding",
        ),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: xchunked\r\n\r\n" + OK_BODY, "Transfer-Encoding"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: \r\ncontent-length: 15\r\n\r\n" + OK_BODY, "empty Transfer-Encoding"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 15\r\ncontent-length: 16\r\n\r\n" + OK_BODY, "conflicting"),
        (b"HTTP/1.1 200 OK\ncontent-length: 15\r\n\r\n" + OK_BODY, "bare LF"),
        (b"HTTP/1.1 200 OK\r\nx-split: a\rset-cookie: b\r\ncontent-length: 15\r\n\r\n" + OK_BODY, "bare CR"),
        (b"HTTP/1.1 200 OK\r\nx-ctl: \x01\r\ncontent-length: 15\r\n\r\n" + OK_BODY, "control character"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\n" + OK_BODY + b"\r\n0\r\n\r\n", "CRLF"),
    ],
)
def test_malformed_upstream_framing_is_a_captured_502(make_proxy, raw_upstream, response: bytes, reason: str):
    answer, url = raw_upstream
    answer[0] = response
    proxy = make_proxy([url])
    r = httpx.post(f"{proxy.openai_base('up')}/chat/completions", content=CHAT, timeout=10)
    assert r.status_code == 502 and reason in r.json()["error"]["message"], r.text
    (rec,) = proxy.records()
    assert rec.header["status"] == "upstream_error" and reason in rec.header["error"]
