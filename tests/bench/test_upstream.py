"""bench/upstream.py: the proxy bench's upstream answers on loopback with production-shaped responses from
bench/data.py, each call its own, the large ones for large requests."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clawpipe.net import free_port

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import data  # noqa: E402


@pytest.fixture
def upstream_port():
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(BENCH / "upstream.py"), str(port), "--pool", "200"])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                http.client.HTTPConnection("127.0.0.1", port, timeout=1).connect()
                break
            except OSError:
                time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def test_each_call_gets_its_own_response_of_its_kind(upstream_port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=10)
    seen: dict[str, list[tuple[int, bytes]]] = {"small": [], "large": []}
    for kind, n in (("small", 60), ("large", 20)):
        for _, body, _ in data.calls(n, data.shape(kind), seed=3):
            conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
            r = conn.getresponse()
            seen[kind].append((r.status, r.read()))
    for kind, answers in seen.items():
        bodies = [b for s, b in answers if s == 200]
        assert len(set(bodies)) == len(bodies), f"{kind}: a response repeated"
        assert all(s in (200, 500) for s, _ in answers)
        ok = [json.loads(b) for b in bodies]
        assert all(o["choices"][0]["token_ids"] and o["prompt_token_ids"] for o in ok)
    small = [len(json.loads(b)["prompt_token_ids"]) for s, b in seen["small"] if s == 200]
    large = [len(json.loads(b)["prompt_token_ids"]) for s, b in seen["large"] if s == 200]
    assert sorted(small)[len(small) // 2] * 10 < sorted(large)[len(large) // 2]


def test_chunked_requests_are_answered_on_the_same_connection(upstream_port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=10)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 20_000}]}).encode()
    for _ in range(2):
        conn.request("POST", "/v1/chat/completions", iter([body[:7000], body[7000:]]), encode_chunked=True)
        r = conn.getresponse()
        payload = r.read()
        assert r.status in (200, 500)
        if r.status == 200:  # a body over 4 KB without max_tokens is a large call
            assert len(json.loads(payload)["prompt_token_ids"]) > 1000


def test_request_body_rows_take_the_upstreams_drawn_errors() -> None:
    """The proxy bench's request-body rows send filler bodies (large calls); the drawn pool answers some
    with 500 (indices 186 and 230 of the large pool at --pool 1024), and the rows read those like any answer."""
    import socket

    import proxy_overhead

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(BENCH / "upstream.py"), str(port), "--pool", "1024"])
    try:
        proxy_overhead.wait_port(port)
        body = proxy_overhead._body_of(64 << 10)
        with socket.create_connection(("127.0.0.1", port)) as sock:
            for i in range(240):
                proxy_overhead._send_body(sock, "/v1/chat/completions", body, chunked=i % 2 == 1)
                proxy_overhead._read_response(sock)
    finally:
        proc.terminate()
        proc.wait(10)
