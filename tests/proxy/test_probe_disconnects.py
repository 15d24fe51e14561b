"""Clients that go away at any point of their call: before the upstream answers, between a streamed answer's
events, halfway through a plain answer's body, or after reading it all; by a close, a reset or a half-close.
Every call is captured exactly once, a call its client left is ``cancelled`` with the status the client saw
(499 when it got none), its record lands, and nothing stays behind in the proxy afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from clawpipe.capture import decode_header
from clawpipe.lake.records import call_values
from tests.proxy.conftest import ProxyHandle, key_for
from tests.support.upstream import ScriptedUpstream, say


def _request(rollout: str, stream: bool) -> bytes:
    body = json.dumps({"model": "m", "stream": stream, "messages": [{"role": "user", "content": rollout}]})
    return (
        f"POST /r/{key_for(rollout)}/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n{body}"
    ).encode()


def _connect(proxy: ProxyHandle) -> socket.socket:
    host, port = proxy.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _lands(rec: Any) -> dict[str, Any]:
    """The record's model_calls values as landing makes them (raises where landing would reject it)."""
    header = decode_header(json.dumps(rec.header).encode())
    return call_values(header, rec.request, rec.response, "seg", 0).call


@pytest.fixture
def half_answer() -> Iterator[tuple[str, threading.Event]]:
    """An upstream that sends a 200 head and part of its body, then nothing more (for 3 s); the event is set
    once the part is sent."""
    sent = threading.Event()
    loop = asyncio.new_event_loop()

    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 400\r\n\r\n{"id": "c1", ')
        await writer.drain()
        sent.set()
        await asyncio.sleep(3)
        writer.close()

    server = loop.run_until_complete(asyncio.start_server(serve, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", sent

    async def close() -> None:
        server.close()
        for conn in writers:
            conn.close()
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()

    asyncio.run_coroutine_threadsafe(close(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def test_a_client_gone_during_a_plain_answers_body_is_captured_as_499_and_lands(make_proxy: Any, half_answer):
    """The upstream's 200 never reached the client: it was captured as a cancelled 200 with half a JSON body,
    which landing rejects as a body that is not JSON."""
    url, sent = half_answer
    proxy = make_proxy([url])
    with _connect(proxy) as s:
        s.sendall(_request("half", stream=False))
        assert sent.wait(5)
        deadline = time.monotonic() + 5  # the proxy has read the upstream's head
        while not any(c.status == 200 for c in list(proxy.server.calls.calls)) and time.monotonic() < deadline:
            time.sleep(0.01)
    deadline = time.monotonic() + 5
    while not proxy.records() and time.monotonic() < deadline:
        time.sleep(0.02)
    (rec,) = proxy.records()
    assert rec.header["status"] == "cancelled" and rec.header["http_status"] == 499
    assert rec.response == b'{"id": "c1", '  # what the upstream sent is kept
    assert _lands(rec)["status"] == "cancelled"


def _client(proxy: ProxyHandle, rollout: str, stream: bool, cut: int, how: str) -> bool:
    """One call whose client reads ``cut`` response bytes at most, then closes (``how``); True when it read the
    whole answer first."""
    s = _connect(proxy)
    s.sendall(_request(rollout, stream))
    got = b""
    whole = False
    while len(got) < cut:
        data = s.recv(min(65536, cut - len(got)))
        if not data:
            break
        got += data
        head, _, body = got.partition(b"\r\n\r\n")
        if stream:
            whole = got.endswith(b"\r\n0\r\n\r\n")
        elif b"content-length: " in head:
            whole = len(body) >= int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
        if whole:
            break
    if how == "reset":
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    elif how == "half-close":
        s.shutdown(socket.SHUT_WR)
    s.close()
    return whole


def _sockets_on(*ports: int) -> Counter[str]:
    """This process's open TCP sockets with a local or remote port in ``ports``, by state (LISTEN, ESTABLISHED,
    CLOSE_WAIT, ...): other tests' sockets, closed any time by the garbage collector, are not counted."""
    names = {"01": "ESTABLISHED", "08": "CLOSE_WAIT", "0A": "LISTEN"}
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out: Counter[str] = Counter()
    with open("/proc/net/tcp") as f:
        for line in f.read().splitlines()[1:]:
            cols = line.split()
            local, remote = (int(a.split(":")[1], 16) for a in cols[1:3])
            if cols[9] in inodes and (local in ports or remote in ports):
                out[names.get(cols[3], cols[3])] += 1
    return out


def test_many_clients_leaving_at_random_points_are_each_captured_once_and_leave_nothing_behind(
    make_proxy: Any,
):
    upstream = ScriptedUpstream(default=say("word " * 30), chunk_delay_s=0.002).start()
    try:
        proxy = make_proxy([upstream.url])
        server = proxy.server
        ports = (server.port, upstream.port)
        rng = random.Random(5)
        plan = {
            f"c{i}": (
                rng.random() < 0.75,
                rng.choice([0, 1, 100, 300, 700, 1500, 10**9]),
                rng.choice(["close", "reset", "half-close"]),
            )
            for i in range(60)
        }
        whole: dict[str, bool] = {}

        def run(rollout: str) -> None:
            whole[rollout] = _client(proxy, rollout, *plan[rollout])

        threads = [threading.Thread(target=run, args=(r,)) for r in plan]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        deadline = time.monotonic() + 10
        while len(proxy.records()) < len(plan) and time.monotonic() < deadline:
            time.sleep(0.05)
        records = proxy.records()
        by_rollout = Counter(r.header["rollout_id"] for r in records)
        assert by_rollout == Counter(list(plan)), "every call captured exactly once"
        assert len(upstream.model_requests()) <= len(records)
        statuses = Counter((r.header["status"], r.header["http_status"], r.header["stream"]) for r in records)
        for rec in records:
            h = rec.header
            if whole[h["rollout_id"]]:
                assert h["status"] == "ok", h
            assert h["status"] in ("ok", "cancelled"), h
            if h["status"] == "cancelled":  # a 200 only where a stream's head had gone out
                assert h["http_status"] == (200 if h["stream"] and h["http_status"] == 200 else 499), h
                assert h["stream"] or h["http_status"] == 499, h
            assert _lands(rec)["status"] == h["status"]
        assert statuses[("cancelled", 499, True)] + statuses[("cancelled", 499, False)] > 0
        assert statuses[("cancelled", 200, True)] > 0 and statuses[("ok", 200, True)] > 0

        def settled() -> bool:
            pooled = sum(r.open for r in server._replicas)  # idle keep-alive connections: both ends are here
            return (
                not server._conns
                and not server._handlers
                and not server.calls.calls
                and server.in_flight == 0
                and server.body_budget.used == 0
                and _sockets_on(*ports) == Counter({"LISTEN": 2, "ESTABLISHED": 2 * pooled})
            )

        deadline = time.monotonic() + 10
        while not settled() and time.monotonic() < deadline:
            time.sleep(0.05)
        conns, handlers, pooled = len(server._conns), len(server._handlers), sum(r.open for r in server._replicas)
        assert settled(), (conns, handlers, server.in_flight, pooled, _sockets_on(*ports))
        loop_tasks = asyncio.run_coroutine_threadsafe(_other_tasks(), server.loop).result(5)
        assert loop_tasks == ["ProxyServer.serve_until_stopped"]
    finally:
        upstream.stop()


async def _other_tasks() -> list[str]:
    me = asyncio.current_task()
    return sorted(t.get_coro().__qualname__ for t in asyncio.all_tasks() if t is not me)  # type: ignore[union-attr]
