"""Upstreams the proxy's own tests had not met: interim 1xx answers, compressed answers, SSE with CRLF line
ends and comments, Retry-After, trailers, a connection closed without an answer. Each call is captured once."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import zlib
from collections.abc import Iterator

import httpx
import pytest

from tests.proxy.conftest import ProxyHandle
from tests.proxy.test_wire import _feed

CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}'
STREAM = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "x"}]}'
ANSWER = json.dumps(
    {
        "id": "c1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
    }
).encode()
CLOSE = b""  # as an answer: close the connection without one


def _whole(body: bytes, *headers: str, status: str = "200 OK") -> bytes:
    head = "".join(h + "\r\n" for h in headers)
    return f"HTTP/1.1 {status}\r\n{head}content-length: {len(body)}\r\n\r\n".encode() + body


class RawUpstream:
    """An upstream that answers the n-th request with the n-th scripted bytes (the last one again after)."""

    def __init__(self) -> None:
        self.answers: list[bytes] = []
        self.heads: list[bytes] = []  # request heads as received
        self.bodies: list[bytes] = []
        self._loop = asyncio.new_event_loop()
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.bodies.append(await reader.readexactly(length))
                self.heads.append(head)
                answer = self.answers[min(len(self.heads), len(self.answers)) - 1]
                if answer == CLOSE:
                    break
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _shutdown(self) -> None:
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


@pytest.fixture
def raw() -> Iterator[RawUpstream]:
    up = RawUpstream()
    yield up
    up.stop()


def _post(proxy: ProxyHandle, body: bytes = CHAT, rollout: str = "r", **kw: object) -> httpx.Response:
    return httpx.post(f"{proxy.openai_base(rollout)}/chat/completions", content=body, timeout=10, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "interim",
    [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nlink: </x>; rel=preload\r\n\r\n"],
    ids=["100", "103"],
)
def test_interim_1xx_answers_are_skipped_and_the_final_answer_served(make_proxy, raw: RawUpstream, interim: bytes):
    raw.answers = [interim + _whole(ANSWER, "content-type: application/json")]
    proxy = make_proxy([raw.url])
    for i in range(2):  # the second call on the same pooled connection: nothing of the first is left over
        r = _post(proxy, rollout=f"i{i}")
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hello", r.text
    records = proxy.records()
    assert [(rec.header["http_status"], rec.header["status"]) for rec in records] == [(200, "ok")] * 2
    assert all(rec.response == ANSWER for rec in records)


def test_interim_answers_are_skipped_under_any_read_split():
    raw = (
        b"HTTP/1.1 100 Continue\r\nconnection: close\r\n\r\n"  # an interim head's fields do not frame the answer
        b"HTTP/1.1 103 Early Hints\r\nlink: </a>; rel=preload\r\n\r\n"
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"
    )
    for cuts in [[i] for i in range(len(raw))] + [list(range(len(raw)))]:
        sink, rep, conn = _feed(raw, cuts)
        assert (sink.status, sink.body, sink.ends, sink.fails) == (200, b"hello", 1, []), cuts
        assert rep.idle == [conn]  # a clean keep-alive end: back in the pool


@pytest.mark.parametrize(
    ("interim", "reason"),
    [
        (b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\n", "101 Switching Protocols"),
        (b"HTTP/1.1 103 Early Hints\r\n\r\n" * 17, "more than 16 interim"),
    ],
    ids=["101", "17x103"],
)
def test_an_upgrade_or_endless_interim_answers_are_a_captured_502(make_proxy, raw: RawUpstream, interim, reason):
    raw.answers = [interim + _whole(ANSWER)]
    proxy = make_proxy([raw.url])
    r = _post(proxy)
    assert r.status_code == 502 and reason in r.json()["error"]["message"], r.text
    (rec,) = proxy.records()
    assert rec.header["status"] == "upstream_error" and reason in rec.header["error"]


def test_the_proxy_asks_upstreams_for_uncompressed_answers(make_proxy, raw: RawUpstream):
    raw.answers = [_whole(ANSWER)]
    proxy = make_proxy([raw.url])
    assert _post(proxy, headers={"accept-encoding": "gzip, br"}).status_code == 200
    assert b"\r\naccept-encoding: identity\r\n" in raw.heads[0].lower()


@pytest.mark.parametrize("coding", ["gzip", "x-gzip", "deflate"])
def test_a_compressed_answer_reaches_client_and_capture_decoded(make_proxy, raw: RawUpstream, coding: str):
    packed = gzip.compress(ANSWER) if "gzip" in coding else zlib.compress(ANSWER)
    raw.answers = [_whole(packed, "content-type: application/json", f"content-encoding: {coding}")]
    proxy = make_proxy([raw.url])
    r = _post(proxy, headers={"accept-encoding": "gzip"})
    assert r.status_code == 200 and "content-encoding" not in r.headers
    assert r.json()["choices"][0]["message"]["content"] == "hello"
    (rec,) = proxy.records()
    assert rec.response == ANSWER and rec.header["status"] == "ok"


def test_a_compressed_stream_is_served_decoded_and_captured_once(make_proxy, raw: RawUpstream):
    events = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n'
    packed = gzip.compress(events)
    raw.answers = [
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-encoding: gzip\r\n"
        b"transfer-encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n" % (len(packed), packed)
    ]
    proxy = make_proxy([raw.url])
    r = _post(proxy, STREAM)
    assert r.status_code == 200 and r.content == events
    (rec,) = proxy.records()
    assert rec.response == events and rec.header["status"] == "ok"


@pytest.mark.parametrize(
    ("coding", "body", "reason"),
    [("br", b"\x8b\x00\x80", "'br'"), ("gzip", b"not gzip at all", "could not be decoded")],
    ids=["br", "not-gzip"],
)
def test_an_answer_that_cannot_be_decoded_is_a_captured_502(make_proxy, raw: RawUpstream, coding, body, reason):
    raw.answers = [_whole(body, f"content-encoding: {coding}")]
    proxy = make_proxy([raw.url])
    r = _post(proxy)
    assert r.status_code == 502 and reason in r.json()["error"]["message"], r.text
    (rec,) = proxy.records()
    assert rec.header["status"] == "upstream_error" and reason in rec.header["error"]


def test_a_compressed_answer_is_decoded_only_up_to_the_response_limit(make_proxy, raw: RawUpstream):
    bomb = gzip.compress(b"{" + b" " * (64 << 20) + b"}")  # 64 MiB of JSON in ~64 KiB
    raw.answers = [_whole(bomb, "content-encoding: gzip")]
    proxy = make_proxy([raw.url], max_response_bytes=1 << 20)
    r = _post(proxy)
    assert r.status_code == 502 and "limit of 1048576 bytes" in r.json()["error"]["message"], r.text
    (rec,) = proxy.records()
    assert rec.header["status"] == "upstream_error" and len(rec.response) < 4096


def test_sse_with_crlf_line_ends_and_ping_comments_streams_through(make_proxy, raw: RawUpstream):
    events = (
        b': ping\r\n\r\ndata: {"choices": [{"delta": {"content": "hi"}}]}\r\n\r\n: ping\r\n\r\ndata: [DONE]\r\n\r\n'
    )
    chunks = b"".join(b"%x\r\n%b\r\n" % (len(events[i : i + 7]), events[i : i + 7]) for i in range(0, len(events), 7))
    raw.answers = [
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        + chunks
        + b"0\r\n\r\n"
    ]
    proxy = make_proxy([raw.url])
    r = _post(proxy, STREAM)
    assert r.status_code == 200 and r.content == events
    (rec,) = proxy.records()
    assert rec.response == events and rec.header["status"] == "ok" and rec.header["stream"] is True


@pytest.mark.parametrize("status", ["429 Too Many Requests", "503 Service Unavailable"])
def test_retry_after_answers_pass_through_and_are_captured_once(make_proxy, raw: RawUpstream, status: str):
    err = b'{"error": {"message": "slow down", "type": "rate_limit"}}'
    raw.answers = [_whole(err, "content-type: application/json", "retry-after: 7", status=status)]
    proxy = make_proxy([raw.url])
    r = _post(proxy)
    assert r.status_code == int(status[:3]) and r.headers["retry-after"] == "7" and r.content == err
    (rec,) = proxy.records()
    assert rec.header["http_status"] == int(status[:3]) and rec.header["status"] == "http_error"
    assert len(raw.heads) == 1


def test_trailers_after_a_chunked_answer_are_dropped_and_the_connection_reused(make_proxy, raw: RawUpstream):
    raw.answers = [
        b"HTTP/1.1 200 OK\r\ntrailer: x-checksum\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n"
        b"x-checksum: abc\r\nx-more: 1\r\n\r\n" % (len(ANSWER), ANSWER)
    ]
    proxy = make_proxy([raw.url])
    for i in range(3):
        r = _post(proxy, rollout=f"t{i}")
        assert r.status_code == 200 and r.content == ANSWER and "trailer" not in r.headers
    assert [rec.response for rec in proxy.records()] == [ANSWER] * 3
    assert proxy.server.replicas.replicas[0].peak == 1  # one upstream connection served all three


def test_an_upstream_closing_without_an_answer_is_a_captured_502(make_proxy, raw: RawUpstream):
    raw.answers = [CLOSE]
    proxy = make_proxy([raw.url])
    r = _post(proxy)
    assert r.status_code == 502 and "closed" in r.json()["error"]["message"], r.text
    (rec,) = proxy.records()
    assert rec.header["status"] == "upstream_error" and rec.request == CHAT
    assert len(raw.heads) == 1  # a fresh connection's request is never sent twice


def test_a_pooled_connection_closed_without_an_answer_is_retried_once_and_captured_once(make_proxy, raw: RawUpstream):
    # the close is read as a keep-alive connection the upstream had already dropped: sent again, on a fresh one
    raw.answers = [_whole(ANSWER), CLOSE, _whole(ANSWER)]
    proxy = make_proxy([raw.url])
    assert _post(proxy, rollout="a").status_code == 200
    r = _post(proxy, rollout="b")
    assert r.status_code == 200 and r.content == ANSWER
    assert [rec.header["rollout_id"] for rec in proxy.records()] == ["a", "b"]
    assert raw.bodies == [CHAT.replace(b"{", b'{"return_token_ids":true,"logprobs":true,', 1)] * 3
    assert proxy.server.stats["upstream_retries"] == 1
