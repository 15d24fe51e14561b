"""The proxy's resource limits: header and idle timeouts, the connection cap, the budget for request bodies
being received, the response size limit and the bounded upstream pool. Each one holds while real calls go on."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from typing import Any

import anthropic
import httpx
import pytest

from tests.proxy.conftest import ProxyHandle, key_for
from tests.support.net import read_all
from tests.support.upstream import ScriptedUpstream, say

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


def _addr(proxy: ProxyHandle) -> tuple[str, int]:
    host, port = proxy.url.removeprefix("http://").split(":")
    return host, int(port)


def _wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _call(proxy: ProxyHandle, rollout: str, **kw: Any) -> httpx.Response:
    return httpx.post(f"{proxy.openai_base(rollout)}/chat/completions", json=CHAT, timeout=15, **kw)


def test_a_connection_that_sends_no_head_is_closed_after_the_header_timeout(make_proxy: Any, upstream) -> None:
    proxy = make_proxy([upstream.url], header_timeout_s=0.5)
    t0 = time.monotonic()
    with socket.create_connection(_addr(proxy), timeout=10) as silent, socket.create_connection(_addr(proxy)) as slow:
        slow.settimeout(10)
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")  # and then a byte now and then
        for _ in range(4):
            time.sleep(0.2)
            with contextlib.suppress(OSError):
                slow.sendall(b"x")
        out_silent, out_slow = read_all(silent), read_all(slow)
    assert time.monotonic() - t0 < 5
    for out in (out_silent, out_slow):
        assert out.startswith(b"HTTP/1.1 408") and b"within 0.5 s" in out
    assert proxy.server.stats["timed_out_connections"] >= 2
    assert _call(proxy, "after").status_code == 200


def test_an_idle_keep_alive_connection_is_closed(make_proxy: Any, upstream) -> None:
    proxy = make_proxy([upstream.url], idle_timeout_s=0.5)
    body = httpx.Request("POST", "http://x", json=CHAT).content
    head = f"POST /r/{key_for('ka')}/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n"
    with socket.create_connection(_addr(proxy), timeout=10) as s:
        s.sendall(head.encode() + body)
        t0 = time.monotonic()
        out = read_all(s)  # the answer, then the close once idle
        idle = time.monotonic() - t0
    assert out.startswith(b"HTTP/1.1 200") and out.count(b"HTTP/1.1") == 1
    assert 0.4 < idle < 5


def test_slow_loris_connections_do_not_starve_real_calls(make_proxy: Any, upstream) -> None:
    """4,000 connections that send half a head: real calls go through meanwhile, and the header timeout closes
    them all (408) within about a second of its limit."""
    proxy = make_proxy([upstream.url], header_timeout_s=1.5, max_connections=4500)
    addr = _addr(proxy)
    loris: list[socket.socket] = []
    try:
        for _ in range(4000):
            s = socket.create_connection(addr, timeout=10)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
            loris.append(s)
        t0 = time.monotonic()
        assert _call(proxy, "real1").status_code == 200
        assert time.monotonic() - t0 < 2
        _wait(lambda: len(proxy.server._conns) <= 1, 10, "half-open connections still open")
        assert _call(proxy, "real2").status_code == 200
        loris[0].settimeout(5)
        assert read_all(loris[0]).startswith(b"HTTP/1.1 408")
    finally:
        for s in loris:
            s.close()
    assert {r.header["rollout_id"] for r in proxy.records()} == {"real1", "real2"}


def test_over_the_connection_limit_a_clear_503(make_proxy: Any, upstream) -> None:
    proxy = make_proxy([upstream.url], max_connections=8)
    held = [socket.create_connection(_addr(proxy), timeout=10) for _ in range(8)]
    try:
        _wait(lambda: len(proxy.server._conns) == 8, 5, "connections not accepted")
        assert proxy.server.snapshot_stats()["connections"] == 8
        r = _call(proxy, "over")
        assert r.status_code == 503
        msg = r.json()["error"]["message"]
        assert "limit of 8 open connections" in msg and "--max-connections" in msg
        client = anthropic.Anthropic(base_url=proxy.anthropic_base("over"), api_key="x", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as err:  # both SDKs read the error's message
            client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "x"}])
        assert err.value.status_code == 503 and "limit of 8 open connections" in str(err.value)
    finally:
        for s in held:
            s.close()
    _wait(lambda: len(proxy.server._conns) == 0, 5, "held connections not closed")
    assert _call(proxy, "after").status_code == 200


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.slow
def test_unfinished_32_mib_bodies_stay_within_the_body_budget(make_proxy: Any, upstream) -> None:
    """20 clients each send 31 of their 32 MiB bodies and stop. The proxy buffers at most its body budget
    (default 128 MiB): the others get a 503 (captured) and their bytes are read and dropped."""
    proxy = make_proxy([upstream.url])
    budget = proxy.server.body_budget
    assert budget.limit == 128 << 20
    piece = b"x" * (1 << 20)
    rss0 = _rss()
    socks = []
    answers: list[bytes] = []
    try:
        for i in range(20):
            s = socket.create_connection(_addr(proxy), timeout=30)
            head = f"POST /r/{key_for(f'b{i}')}/v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            s.sendall(head.encode() + b"content-length: %d\r\n\r\n" % (32 << 20))
            socks.append(s)
        for s in socks:
            for _ in range(31):
                s.sendall(piece)
        _wait(lambda: len(proxy.records()) == 16, 20, "refused calls not captured")
        grew = _rss() - rss0
        for s in socks[4:]:
            s.settimeout(5)
            answers.append(s.recv(65536))
    finally:
        for s in socks:
            s.close()
    assert budget.peak <= budget.limit
    assert grew < 200 << 20, f"RSS grew by {grew >> 20} MiB"
    assert all(a.startswith(b"HTTP/1.1 503") and b"--max-buffered-mb" in a for a in answers)
    assert all(r.header["http_status"] == 503 for r in proxy.records())
    _wait(lambda: budget.used == 0, 5, "budget not given back")


def test_a_chunked_body_over_the_budget_is_a_captured_503(make_proxy: Any, upstream) -> None:
    proxy = make_proxy([upstream.url], max_buffered_bytes=100_000)

    def pieces():
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(50):
            yield b"x" * 10_000
        yield b'"}]}'

    r = httpx.post(f"{proxy.openai_base('chunky')}/chat/completions", content=pieces(), timeout=40)
    assert r.status_code == 503 and "request bodies" in r.json()["error"]["message"]
    (rec,) = proxy.records()
    assert rec.header["http_status"] == 503 and upstream.requests == []
    _wait(lambda: proxy.server.body_budget.used == 0, 5, "budget not given back")
    small = _call(proxy, "small")
    assert small.status_code == 200


def test_a_trickled_body_holds_no_budget_and_is_cut_below_the_minimum_rate(make_proxy: Any, upstream) -> None:
    """A client (no key needed) declares a body as large as the whole body budget and sends it 10 bytes every
    0.2 s, never pausing as long as the header timeout: a declared length reserves nothing, so real calls go
    through meanwhile, and it gets a 408 once it falls below the minimum average rate."""
    proxy = make_proxy([upstream.url], header_timeout_s=1.0, max_buffered_bytes=1 << 20, max_body_bytes=1 << 20)
    stop = threading.Event()

    def trickle(s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                s.sendall(b"x" * 10)
                time.sleep(0.2)

    with socket.create_connection(_addr(proxy), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (1 << 20))
        t0 = time.monotonic()
        sender = threading.Thread(target=trickle, args=(s,))
        sender.start()
        try:
            time.sleep(0.3)
            assert _call(proxy, "real").status_code == 200
            out = read_all(s)
        finally:
            stop.set()
            sender.join()
    assert out.startswith(b"HTTP/1.1 408") and b"slower than 1 MiB/s" in out, out[:200]
    assert time.monotonic() - t0 < 8  # cut soon after the header timeout, not whenever the client stops
    assert [r.header["rollout_id"] for r in proxy.records()] == ["real"]
    _wait(lambda: proxy.server.body_budget.used == 0, 5, "budget not given back")


def test_a_response_over_the_limit_ends_the_call_as_a_captured_error(make_proxy: Any, upstream) -> None:
    proxy = make_proxy([upstream.url], max_response_bytes=20_000)
    big = "y" * 50_000
    upstream.push(say(big), say(big))
    r = _call(proxy, "plain")
    assert r.status_code == 502 and "limit of 20000 bytes" in r.json()["error"]["message"]
    url = f"{proxy.openai_base('streamed')}/chat/completions"
    with (  # the stream is cut: the client sees it incomplete
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream("POST", url, json={**CHAT, "stream": True}, timeout=15) as s,
    ):
        for _ in s.iter_bytes():
            pass
    _wait(lambda: len(proxy.records()) == 2, 5, "calls not captured")
    by = {x.header["rollout_id"]: x for x in proxy.records()}
    assert set(by) == {"plain", "streamed"}  # each exactly once
    for rec in by.values():
        assert rec.header["status"] == "upstream_error" and "limit of 20000 bytes" in rec.header["error"]
        assert len(rec.response) <= 20_000
    assert by["plain"].header["response_partial"] > 20_000
    assert _call(proxy, "after").status_code == 200


def _peak_upstream_connections(upstream: ScriptedUpstream, stop: threading.Event, out: list[int]) -> None:
    while not stop.is_set():
        out.append(len(upstream._writers))
        time.sleep(0.005)


@pytest.mark.slow
def test_concurrent_calls_share_a_bounded_upstream_pool(make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """600 calls at once through a pool of 16 connections: all answered, never more than 16 upstream
    connections (counted by the upstream itself)."""
    upstream.delay_s = 0.05
    proxy = make_proxy([upstream.url], max_upstream_conns=16)
    counts: list[int] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_peak_upstream_connections, args=(upstream, stop, counts))
    watcher.start()

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=600, max_keepalive_connections=600)
        async with httpx.AsyncClient(limits=limits, timeout=60) as client:
            url = f"{proxy.openai_base('pool')}/chat/completions"
            rs = await asyncio.gather(*(client.post(url, json=CHAT) for _ in range(600)))
        return [r.status_code for r in rs]

    try:
        statuses = asyncio.run(run())
    finally:
        stop.set()
        watcher.join()
    assert statuses == [200] * 600
    (rep,) = proxy.server._replicas
    assert rep.peak == 16 and max(counts) <= 16
    assert len(proxy.records()) == 600
