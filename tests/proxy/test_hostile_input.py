"""Hostile or odd input at the proxy's edges: none of it stops the proxy, and every call that reached it is
captured exactly once with a clear status."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from tests.proxy.conftest import ADMIN, ProxyHandle, key_for
from tests.support.upstream import ScriptedUpstream, say

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


def _raw(url: str, data: bytes, timeout: float = 5.0) -> bytes:
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out:
                    break
        except TimeoutError:
            pass
        return out


def _base(proxy: ProxyHandle) -> str:
    return proxy.openai_base("r1").split("/r/")[0]


def _still_serves(proxy: ProxyHandle) -> None:
    r = httpx.post(f"{proxy.openai_base('after')}/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 200


@pytest.mark.parametrize("size", [b"-6", b"+6", b"0x6", b"6_0"])
def test_a_malformed_chunk_size_is_400_and_the_proxy_keeps_serving(proxy: ProxyHandle, upstream, size: bytes):
    head = f"POST /r/{key_for('rc')}/v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    out = _raw(_base(proxy), head.encode() + size + b"\r\nabcdef\r\n0\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400")
    _still_serves(proxy)


def test_an_upstream_with_a_negative_chunk_size_is_a_502(make_proxy: Any) -> None:
    async def bad(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n-6\r\nabcdef\r\n")
        await writer.drain()
        await asyncio.sleep(5)
        writer.close()

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(bad, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        proxy = make_proxy([f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"])
        r = httpx.post(f"{proxy.openai_base('rb')}/chat/completions", json=CHAT, timeout=10)
        assert r.status_code == 502 and "malformed chunk size" in r.json()["error"]["message"]
        health = httpx.get(f"{_base(proxy)}/admin/health", headers={"authorization": f"Bearer {ADMIN}"}, timeout=5)
        assert health.status_code == 200
        (rec,) = proxy.records()
        assert rec.header["status"] == "upstream_error"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_end_markers_inside_generated_text_do_not_hold_the_stream() -> None:
    """Only a stream's real last event (at the start of an SSE line, even split across reads) holds bytes."""
    from clawpipe.proxy.call import Call

    class Client:
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        def write(self, data: bytes) -> None:
            self.sent.append(data)

    def feed(pieces: list[bytes]) -> tuple[int, bool]:
        client = Client()
        call = Call(client, True, asyncio.new_event_loop())  # type: ignore[arg-type]
        call.streaming = True
        for p in pieces:
            call.up_body(p)
        return len(client.sent), call.holding

    text = b'data: {"choices": [{"delta": {"content": "[DONE] and message_stop are words"}}]}\n\n'
    assert feed([text, text]) == (2, False)
    assert feed([text, b"data: [DO", b"NE]\n\n"]) == (2, True)  # the marker split across reads
    assert feed([b"event: message_stop\ndata: {}\n\n"]) == (0, True)  # the first line of a stream
    assert feed([text, b'\ndata: {"type":"response.completed"}\n\n']) == (1, True)


def test_calls_in_flight_at_shutdown_are_captured_and_answered(make_proxy: Any, upstream: ScriptedUpstream) -> None:
    upstream.hang = True
    proxy = make_proxy([upstream.url])
    out: dict[str, Any] = {}

    def plain() -> None:
        out["plain"] = httpx.post(f"{proxy.openai_base('p1')}/chat/completions", json=CHAT, timeout=30)

    def streamed() -> None:
        try:
            with httpx.stream(
                "POST", f"{proxy.openai_base('p2')}/chat/completions", json={**CHAT, "stream": True}, timeout=30
            ) as r:
                out["stream"] = r.read()
        except httpx.HTTPError as exc:
            out["stream"] = exc

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while proxy.server.in_flight < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proxy.server.stop(drain_timeout_s=0.3)
    for t in threads:
        t.join(15)
    assert out["plain"].status_code == 503 and "shut down" in out["plain"].json()["error"]["message"]
    records = proxy.records()
    assert sorted(r.header["rollout_id"] for r in records) == ["p1", "p2"]
    assert all(r.header["status"] == "cancelled" for r in records)


def test_a_client_gone_during_a_pause_is_captured(proxy: ProxyHandle, upstream) -> None:
    server = proxy.server
    loop = server._loop
    asyncio.run_coroutine_threadsafe(server.pause_calls(1), loop).result(10)
    head = f"POST /r/{key_for('gone')}/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    body = httpx.Request("POST", "http://x", json=CHAT).content
    with socket.create_connection(_base(proxy).removeprefix("http://").split(":")) as s:  # type: ignore[arg-type]
        s.sendall(head.encode() + b"content-length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.3)
    time.sleep(0.3)
    loop.call_soon_threadsafe(server.resume_calls, 7)
    deadline = time.monotonic() + 10
    while not proxy.records():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (rec,) = proxy.records()
    assert rec.header["rollout_id"] == "gone" and rec.header["status"] == "cancelled"


def test_odd_keys_and_bodies_get_clear_4xx_answers(proxy: ProxyHandle, upstream) -> None:
    url = f"{_base(proxy)}/v1/chat/completions"
    non_ascii = _raw(
        _base(proxy),
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-api-key: cp1.abc.\xe9\r\ncontent-length: 2\r\n\r\n{}",
    )
    assert non_ascii.startswith(b"HTTP/1.1 401")
    # a stray bearer token does not hide a valid x-api-key (Anthropic harnesses may carry both)
    both = httpx.post(
        url, json=CHAT, headers={"authorization": "Bearer dummy", "x-api-key": key_for("both")}, timeout=10
    )
    assert both.status_code == 200
    deep = httpx.post(
        f"{proxy.openai_base('deep')}/chat/completions", content=b"[" * 100_000 + b"]" * 100_000, timeout=10
    )
    assert deep.status_code == 400 and "not valid JSON" in deep.json()["error"]["message"]
    statuses = {r.header["rollout_id"]: r.header["http_status"] for r in proxy.records()}
    assert statuses == {"both": 200, "deep": 400}


def test_an_over_limit_chunked_body_is_413_and_captured(make_proxy: Any, upstream) -> None:
    proxy = make_proxy([upstream.url], max_body_bytes=1000)

    def pieces():
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(50):
            yield b"x" * 1000
        yield b'"}]}'

    r = httpx.post(f"{proxy.openai_base('big')}/chat/completions", content=pieces(), timeout=40)
    assert r.status_code == 413 and "exceeds the proxy limit" in r.json()["error"]["message"]
    (rec,) = proxy.records()
    assert rec.header["rollout_id"] == "big" and rec.header["http_status"] == 413 and upstream.requests == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/admin/pause", {"wait_s": "abc"}),
        ("/admin/pause", {"wait_s": None}),
        ("/admin/policy_version", {"policy_version": True}),
        ("/admin/resume", {"policy_version": 1.5}),
    ],
)
def test_bad_admin_arguments_are_400(proxy: ProxyHandle, path: str, body: dict[str, Any]) -> None:
    r = httpx.post(f"{_base(proxy)}{path}", json=body, headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert r.status_code == 400
    assert proxy.server.policy_version == 0 and not proxy.server.paused


def test_an_http_1_0_client_gets_its_stream_until_close(proxy: ProxyHandle, upstream: ScriptedUpstream) -> None:
    upstream.push(say("streamed to an old client"))
    body = httpx.Request("POST", "http://x", json={**CHAT, "stream": True}).content
    head = f"POST /r/{key_for('old')}/v1/chat/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
    host, port = _base(proxy).removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head.encode() + b"content-length: %d\r\n\r\n" % len(body) + body)
        out = b""
        while chunk := s.recv(65536):  # the proxy closes the connection at the end of the stream
            out += chunk
    head_out, _, stream = out.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head_out.lower() and stream.startswith(b"data: ")
    assert stream.rstrip().endswith(b"data: [DONE]")
    (rec,) = proxy.records()
    assert rec.header["status"] == "ok" and rec.response == stream


def test_calls_waiting_for_an_upstream_connection_at_shutdown_are_captured_once(
    make_proxy: Any, upstream: ScriptedUpstream
) -> None:
    """One upstream connection allowed, the upstream hangs: one call holds it, two wait in line. Stopping the
    proxy answers all three and captures each exactly once."""
    upstream.hang = True
    proxy = make_proxy([upstream.url], max_upstream_conns=1)
    out: dict[str, httpx.Response] = {}

    def call(name: str) -> None:
        out[name] = httpx.post(f"{proxy.openai_base(name)}/chat/completions", json=CHAT, timeout=30)

    threads = [threading.Thread(target=call, args=(f"w{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while proxy.server.in_flight < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    (rep,) = proxy.server._replicas
    assert rep.open == 1 and len(rep._waiters) == 2
    proxy.server.stop(drain_timeout_s=0.3)
    for t in threads:
        t.join(15)
    assert sorted(r.status_code for r in out.values()) == [503, 503, 503]
    records = proxy.records()
    assert sorted(r.header["rollout_id"] for r in records) == ["w0", "w1", "w2"]
    assert all(r.header["http_status"] == 503 for r in records)


def test_an_internal_error_is_answered_and_captured_once(proxy: ProxyHandle, upstream, monkeypatch) -> None:
    import clawpipe.proxy.body as body_mod

    def broken(*args: Any) -> Any:
        raise RuntimeError("bug")

    monkeypatch.setattr(body_mod, "prepare_body", broken)
    r = httpx.post(f"{proxy.openai_base('bug')}/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 500 and "internal proxy error" in r.json()["error"]["message"]
    (rec,) = proxy.records()
    assert rec.header["rollout_id"] == "bug" and rec.header["http_status"] == 500
    monkeypatch.undo()
    _still_serves(proxy)
