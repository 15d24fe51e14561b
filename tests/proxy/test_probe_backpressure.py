"""A client slower than its stream: the proxy stops reading the upstream while the client's buffer is full
(backpressure), and the upstream connection must read again before it serves the next call."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from clawpipe.proxy.framing import ChunkedBody
from tests.proxy.conftest import ProxyHandle, key_for

HIGH_WATER = 65536  # the write buffer above which a transport pauses its protocol (asyncio's and uvloop's default)


def _event(text: str) -> bytes:
    """One Chat Completions stream event; no end marker ([DONE]) in any: the stream ends with its last chunk."""
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class SlowClientUpstream:
    """An upstream that streams a Chat Completions answer without a [DONE] event, sized so that the last read
    of it is the one that fills the client's buffer past its high-water mark: it sends small events until the
    proxy holds some bytes for the client, then one event that takes them past the mark, with the stream's end.
    Plain calls get a small JSON answer. One thread per connection, keep-alive."""

    def __init__(self, buffered: Any) -> None:
        self.buffered = buffered  # () -> bytes the proxy holds unsent for the streaming client
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.streams_sent = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as f:
            while True:
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    line = f.readline()
                    if not line:
                        return
                    head += line
                body = json.loads(f.read(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])))
                if body.get("stream"):
                    self._stream(conn)
                else:
                    out = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]})
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(out), out.encode()))

    def _stream(self, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        deadline = time.monotonic() + 10
        while self.buffered() < 6000 and time.monotonic() < deadline:  # the kernel's buffers are full
            conn.sendall(_chunk(_event("a" * 16000)))
            time.sleep(0.001)
        # one read (under one loopback segment): its bytes take the proxy's buffer for the client past the mark
        last = _event("b" * (HIGH_WATER - self.buffered() + 500))
        conn.sendall(_chunk(last) + b"0\r\n\r\n")
        self.streams_sent.set()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def slow_setup(make_proxy: Any) -> Iterator[tuple[ProxyHandle, SlowClientUpstream]]:
    box: list[ProxyHandle] = []

    def buffered() -> int:
        conns = list(box[0].server._conns) if box else []
        return max((c.transport.get_write_buffer_size() for c in conns if c.call is not None), default=0)

    upstream = SlowClientUpstream(buffered)
    box.append(make_proxy([upstream.url], upstream_timeout_s=5, max_upstream_conns=1))
    yield box[0], upstream
    upstream.close()


def _post(proxy: ProxyHandle, stream: bool, rcvbuf: int | None = None) -> socket.socket:
    body = json.dumps({"model": "m", "stream": stream, "messages": [{"role": "user", "content": "x"}]})
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    host, port = proxy.url.removeprefix("http://").split(":")
    s.connect((host, int(port)))
    s.settimeout(15)
    s.sendall(
        (
            f"POST /r/{key_for('slow')}/v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n{body}"
        ).encode()
    )
    return s


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while data := s.recv(1 << 16):
        out += data
    s.close()
    return out


def test_the_upstream_connection_of_a_stream_that_ended_under_backpressure_serves_the_next_call(slow_setup):
    """It went back to the pool with its reading paused: the next call sent on it never read its answer and
    was a 504 after --upstream-timeout (600 s by default)."""
    proxy, upstream = slow_setup
    s = _post(proxy, stream=True, rcvbuf=4096)  # a client that reads nothing until the upstream has sent it all
    assert upstream.streams_sent.wait(15)
    time.sleep(0.2)
    streamed = _read_all(s)
    assert streamed.startswith(b"HTTP/1.1 200") and streamed.endswith(b"\r\n0\r\n\r\n")
    assert all(r.open == 1 for r in proxy.server._replicas)  # the one connection, back in the pool
    t0 = time.monotonic()
    answer = _read_all(_post(proxy, stream=False))
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert time.monotonic() - t0 < 2
    records = proxy.records()
    assert [(r.header["stream"], r.header["status"]) for r in records] == [(True, "ok"), (False, "ok")]
    sent = ChunkedBody(1 << 30)
    sent.feed(streamed.partition(b"\r\n\r\n")[2])
    assert sent.done and records[0].response == sent.body()  # what the client got is what was captured
