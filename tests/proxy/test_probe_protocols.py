"""Clients that speak something other than plain HTTP/1.1 request/response at the proxy: HTTP/2 with prior
knowledge (curl ``--http2-prior-knowledge``, Node's ``http2``), the h2c upgrade (curl ``--http2``), WebSocket
handshakes (the Realtime API's shape) and ``CONNECT`` tunnels (a client given the proxy as ``HTTPS_PROXY``).
Each gets a clear answer in a form it reads, quickly, and nothing reaches the upstream that it cannot serve."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time

import openai
import pytest
from websockets.exceptions import InvalidStatus

from tests.proxy.conftest import ProxyHandle, key_for
from tests.support.net import read_all
from tests.support.upstream import ScriptedUpstream

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
# What an HTTP/2 client sends first: the connection preface, then its SETTINGS frame (empty here).
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
HTTP_1_1_REQUIRED = 0xD

needs_node = pytest.mark.skipif(shutil.which("node") is None, reason="needs node (Node.js)")


def _frames(data: bytes) -> list[tuple[int, int, bytes]]:
    """(type, stream id, payload) of each HTTP/2 frame in ``data``."""
    out = []
    while len(data) >= 9:
        length = int.from_bytes(data[:3], "big")
        out.append((data[3], int.from_bytes(data[5:9], "big") & 0x7FFFFFFF, data[9 : 9 + length]))
        data = data[9 + length :]
    assert not data, f"trailing bytes that are no frame: {data[:40]!r}"
    return out


def _connect(proxy: ProxyHandle) -> socket.socket:
    host, port = proxy.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def test_an_http2_prior_knowledge_client_is_told_in_http2_that_http_1_1_is_required(
    proxy: ProxyHandle, upstream: ScriptedUpstream
):
    """It reads HTTP/2 frames only: an HTTP/1.1 error reached it as a protocol error or a broken pipe."""
    with _connect(proxy) as s:
        s.sendall(H2_PREFACE)
        t0 = time.monotonic()
        out = read_all(s)  # the proxy closes the connection after its answer
        took = time.monotonic() - t0
    frames = _frames(out)
    assert [(kind, stream) for kind, stream, _ in frames] == [(0x4, 0), (0x7, 0)]  # SETTINGS, GOAWAY
    goaway = frames[1][2]
    assert int.from_bytes(goaway[:4], "big") == 0  # no stream was processed: the client may send it again
    assert int.from_bytes(goaway[4:8], "big") == HTTP_1_1_REQUIRED
    assert b"HTTP/1.1 only" in goaway[8:]
    assert took < 4
    assert upstream.requests == [] and proxy.records() == []
    with _connect(proxy) as s:  # and the proxy goes on serving
        s.sendall(b"GET /admin/health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert read_all(s).startswith(b"HTTP/1.1 401")


def test_curl_with_http2_prior_knowledge_reads_the_refusal(proxy: ProxyHandle, upstream: ScriptedUpstream):
    url = f"{proxy.openai_base('h2')}/chat/completions"
    out = subprocess.run(
        ["curl", "-sS", "-v", "-m", "10", "--http2-prior-knowledge", "-d", json.dumps(CHAT), url],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "GOAWAY, error=13" in out.stderr  # 13: HTTP_1_1_REQUIRED; before: "Send failure: Broken pipe"
    assert out.returncode not in (0, 28)  # an error at once (curl 7.88: 16, its HTTP/2 framing error), not a timeout
    assert upstream.requests == [] and proxy.records() == []


@needs_node
def test_node_http2_client_gets_goaway_with_the_reason(proxy: ProxyHandle, upstream: ScriptedUpstream, tmp_path):
    script = tmp_path / "h2.mjs"
    script.write_text(
        """
import http2 from 'node:http2';
const [url, path] = process.argv.slice(2);
const session = http2.connect(url);
const seen = {};
session.on('goaway', (code, last, data) => { seen.code = code; seen.debug = data ? data.toString() : ''; });
session.on('error', e => { seen.error = e.code; });
const req = session.request({':method': 'POST', ':path': path, 'content-type': 'application/json'});
req.on('error', () => {});
req.on('response', h => { seen.status = h[':status']; });
req.on('close', () => { console.log(JSON.stringify(seen)); session.destroy(); });
req.end(process.argv[4]);
"""
    )
    path = f"/r/{key_for('node-h2')}/v1/chat/completions"
    out = subprocess.run(
        ["node", str(script), proxy.url, path, json.dumps(CHAT)], capture_output=True, text=True, timeout=30
    )
    seen = json.loads(out.stdout)
    assert seen["code"] == HTTP_1_1_REQUIRED and "HTTP/1.1 only" in seen["debug"]
    assert "status" not in seen
    assert upstream.requests == [] and proxy.records() == []


def test_curl_asking_for_an_h2c_upgrade_is_served_over_http_1_1(proxy: ProxyHandle, upstream: ScriptedUpstream):
    """The upgrade is optional for the server (RFC 9110 7.8): the request is answered in HTTP/1.1, no hang."""
    url = f"{proxy.openai_base('h2c')}/chat/completions"
    out = subprocess.run(
        [
            "curl",
            "-sS",
            "-v",
            "-m",
            "10",
            "--http2",
            "-H",
            "content-type: application/json",
            "-d",
            json.dumps(CHAT),
            url,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert "Upgrade: h2c" in out.stderr and "< HTTP/1.1 200" in out.stderr
    assert json.loads(out.stdout)["choices"][0]["message"]["content"] == "ok"
    (rec,) = proxy.records()
    assert rec.header["status"] == "ok" and rec.header["rollout_id"] == "h2c"


def test_the_openai_realtime_client_is_refused_with_a_501_that_names_websocket(
    proxy: ProxyHandle, upstream: ScriptedUpstream
):
    """The OpenAI SDK's Realtime client opens ``GET /v1/realtime`` with ``Upgrade: websocket``: it was a 404
    listing the paths served, which reads as a wrong base URL; the call is captured once."""
    client = openai.OpenAI(base_url=proxy.openai_base("realtime"), api_key="unused", max_retries=0)
    with pytest.raises(InvalidStatus) as err, client.realtime.connect(model="m"):  # ws:// for an http base URL
        pass
    response = err.value.response
    assert response.status_code == 501
    assert "WebSocket connections are not served" in json.loads(response.body)["error"]["message"]
    (rec,) = proxy.records()
    assert rec.header["http_status"] == 501 and rec.header["status"] == "http_error"
    assert rec.header["path"] == "/v1/realtime" and rec.header["query"] == "model=m"
    assert upstream.requests == []


@pytest.mark.parametrize("target", ["/v1/responses", "/v1/chat/completions", "/v1/realtime?model=m"])
def test_a_websocket_handshake_on_any_path_is_a_captured_501(proxy: ProxyHandle, upstream, target: str):
    head = (
        f"GET /r/{key_for('ws')}{target} HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\nupgrade: websocket\r\n"
        "sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    with _connect(proxy) as s:
        s.sendall(head.encode() + b"GET /admin/health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        out = read_all(s)
    assert out.startswith(b"HTTP/1.1 501 ") and b"Upgrade: websocket" in out
    assert out.count(b"HTTP/1.1 ") == 2  # no 101; the connection goes on in HTTP/1.1
    (rec,) = proxy.records()
    assert rec.header["http_status"] == 501 and rec.header["rollout_id"] == "ws"
    assert upstream.requests == []


def test_a_client_given_the_proxy_as_https_proxy_is_told_it_is_no_forward_proxy(
    proxy: ProxyHandle, upstream: ScriptedUpstream
):
    """``CONNECT host:443`` was a 401 asking for a rollout key, which sends the user after the wrong fault."""
    out = subprocess.run(
        ["curl", "-sS", "-m", "10", "--proxy", proxy.url, "https://api.openai.com/v1/models"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 56 and "response 501" in out.stderr
    with _connect(proxy) as s:
        s.sendall(b"CONNECT api.openai.com:443 HTTP/1.1\r\nhost: api.openai.com:443\r\n\r\n")
        answer = read_all(s)  # the proxy closes the connection after it
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 501 ")
    message = json.loads(body)["error"]["message"]
    assert "no forward proxy" in message and "/r/<key>/v1" in message
    assert upstream.requests == [] and proxy.records() == []
