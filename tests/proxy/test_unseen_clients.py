"""Clients the proxy's own tests had not met: curl's ``Expect: 100-continue``, HTTP/1.0, pipelining, compressed
bodies, query strings and paths of other APIs, odd and duplicated headers. Each call is captured exactly once."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.proxy.conftest import ProxyHandle, key_for
from tests.support.net import read_all
from tests.support.upstream import ScriptedUpstream, say


def _chat(content: str = "x") -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()


def _post_head(path: str, *lines: str, version: str = "HTTP/1.1") -> bytes:
    head = f"POST {path} {version}\r\nhost: x\r\ncontent-type: application/json\r\n"
    return (head + "".join(line + "\r\n" for line in lines) + "\r\n").encode()


def _connect(proxy: ProxyHandle, timeout: float = 10.0) -> socket.socket:
    host, port = proxy.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def _responses(data: bytes) -> list[tuple[bytes, bytes]]:
    """(status line, body) of each content-length framed response in ``data``."""
    out = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next(int(v) for n, _, v in (ln.partition(b": ") for ln in lines[1:]) if n.lower() == b"content-length")
        out.append((lines[0], rest[:length]))
        data = rest[length:]
    return out


def test_curl_sends_a_large_body_after_100_continue_and_it_is_captured_once(
    proxy: ProxyHandle, upstream: ScriptedUpstream, tmp_path: Path
):
    body = _chat("y" * 30_000)
    f = tmp_path / "body.json"
    f.write_bytes(body)
    out = subprocess.run(  # curl asks by itself only for bodies over 1 MiB (older ones: over 1 KiB)
        [
            "curl",
            "-sS",
            "-v",
            "-H",
            "content-type: application/json",
            "-H",
            "Expect: 100-continue",
            "--data-binary",
            f"@{f}",
            f"{proxy.openai_base('curl')}/chat/completions",
        ],
        capture_output=True,
        timeout=30,
        check=True,
    )
    assert b"Expect: 100-continue" in out.stderr and b"HTTP/1.1 100 Continue" in out.stderr
    assert json.loads(out.stdout)["choices"][0]["message"]["content"] == "ok"
    (rec,) = proxy.records()
    assert rec.request == body and rec.header["status"] == "ok"
    assert len(upstream.model_requests()) == 1


def test_a_client_that_waits_for_100_continue_gets_it_before_sending_its_body(proxy: ProxyHandle, upstream):
    body = _chat("z" * 5000)
    with _connect(proxy) as s:
        s.sendall(
            _post_head(
                f"/r/{key_for('expect')}/v1/chat/completions", f"content-length: {len(body)}", "expect: 100-continue"
            )
        )
        interim = s.recv(100)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        time.sleep(0.3)  # the body follows only after the interim answer
        s.sendall(
            body + _post_head(f"/r/{key_for('expect')}/v1/chat/completions", "content-length: 0", "connection: close")
        )
        out = read_all(s)
    assert out.startswith(b"HTTP/1.1 200") and out.count(b"HTTP/1.1 100") == 0
    records = proxy.records()
    assert [r.request for r in records] == [body, b""]
    assert [r.header["seq"] for r in records] == [0, 1]


def test_pipelined_requests_are_answered_in_order_and_each_captured_once(proxy: ProxyHandle, upstream):
    upstream.push(say("first"), say("second"), say("third"))
    reqs = b"".join(
        _post_head(f"/r/{key_for(rid)}/v1/chat/completions", f"content-length: {len(_chat(rid))}") + _chat(rid)
        for rid in ("pa", "pb", "pc")
    )
    with _connect(proxy) as s:
        s.sendall(reqs + _post_head("/admin/health", "content-length: 0", "connection: close"))
        out = read_all(s)
    answers = _responses(out)
    texts = [json.loads(b)["choices"][0]["message"]["content"] for _, b in answers[:3]]
    assert texts == ["first", "second", "third"]
    records = proxy.records()
    assert [r.header["rollout_id"] for r in records] == ["pa", "pb", "pc"]
    assert [json.loads(r.request)["messages"][0]["content"] for r in records] == ["pa", "pb", "pc"]
    assert [b"first" in r.response for r in records] == [True, False, False]


@pytest.mark.parametrize("close", ["HTTP/1.0", "connection: close"])
def test_http_1_0_and_connection_close_clients_get_one_answer_then_a_close(proxy: ProxyHandle, upstream, close: str):
    body = _chat()
    extra = ["connection: close"] if close.startswith("connection") else []
    version = "HTTP/1.0" if close == "HTTP/1.0" else "HTTP/1.1"
    with _connect(proxy) as s:
        path = f"/r/{key_for('close')}/v1/chat/completions"
        s.sendall(_post_head(path, f"content-length: {len(body)}", *extra, version=version) + body)
        out = read_all(s)  # ends: the proxy closed the connection
    ((status, answer),) = _responses(out)
    assert status.startswith(b"HTTP/1.1 200") and b"connection: close" in out.lower()
    assert json.loads(answer)["choices"]
    (rec,) = proxy.records()
    assert rec.request == body


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "zstd"])
def test_a_body_in_any_content_coding_is_a_captured_415_naming_it(proxy: ProxyHandle, upstream, coding: str):
    packed = b"\x1f\x8b\x08\x00" + b"\x00" * 64  # never decoded: the coding alone decides
    r = httpx.post(
        f"{proxy.openai_base('coded')}/chat/completions", content=packed, headers={"content-encoding": coding}
    )
    assert r.status_code == 415, r.text
    assert r.headers["accept-encoding"] == "identity"  # the coding the proxy takes
    assert f"Content-Encoding '{coding}' is not supported" in r.json()["error"]["message"]
    (rec,) = proxy.records()
    assert rec.request == packed and rec.header["http_status"] == 415
    assert upstream.requests == []


def test_query_strings_on_model_paths_are_forwarded_and_captured(proxy: ProxyHandle, upstream):
    r = httpx.post(
        f"{proxy.anthropic_base('beta')}/v1/messages?beta=true",
        json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]},
        headers={"anthropic-version": "2023-06-01"},
    )
    assert r.status_code == 200 and r.json()["type"] == "message"
    (seen,) = upstream.model_requests()
    assert seen.path == "/v1/messages" and seen.query == "beta=true"
    (rec,) = proxy.records()
    assert rec.header["query"] == "beta=true" and rec.header["api"] == "messages"


@pytest.mark.parametrize(
    "path",
    [
        "/openai/deployments/gpt/chat/completions?api-version=2024-10-21",
        "/v1beta/models/gemini:generateContent",
        "/v1beta/models/gemini:streamGenerateContent?alt=sse",
    ],
)
def test_paths_of_other_apis_are_a_captured_404_naming_what_is_served(proxy: ProxyHandle, upstream, path: str):
    r = httpx.post(f"{proxy.url}/r/{key_for('other')}{path}", content=_chat())
    assert r.status_code == 404
    msg = r.json()["error"]["message"]
    assert path.partition("?")[0] in msg and "/v1/chat/completions" in msg and "/v1/messages" in msg
    (rec,) = proxy.records()
    assert rec.header["http_status"] == 404 and rec.header["api"] == "unknown"
    assert rec.header["query"] == path.partition("?")[2]
    assert upstream.requests == []


def test_five_hundred_headers_and_non_ascii_values_are_served(proxy: ProxyHandle, upstream):
    body = _chat()
    lines = [f"x-h{i}: v{i}" for i in range(500)]
    head = _post_head(
        f"/r/{key_for('many')}/v1/chat/completions", *lines, f"content-length: {len(body)}", "connection: close"
    )
    head = head.replace(b"x-h0: v0", "x-h0: caf\u00e9 \u00fc".encode())
    with _connect(proxy) as s:
        s.sendall(head + body)
        out = read_all(s)
    assert out.startswith(b"HTTP/1.1 200"), out[:200]
    (rec,) = proxy.records()
    assert rec.request == body


@pytest.mark.parametrize("name", ["authorization", "x-api-key"])
def test_two_rollout_keys_in_one_header_name_are_refused(proxy: ProxyHandle, upstream, name: str):
    body = _chat()
    prefix = "Bearer " if name == "authorization" else ""
    with _connect(proxy) as s:
        s.sendall(
            _post_head(
                "/v1/chat/completions",
                f"{name}: {prefix}{key_for('one')}",
                f"{name}: {prefix}{key_for('two')}",
                f"content-length: {len(body)}",
            )
            + body
        )
        out = read_all(s)
    assert out.startswith(b"HTTP/1.1 400"), out[:200]
    assert f"more than one {name} header".encode() in out.lower()
    assert proxy.records() == [] and upstream.requests == []
    # the same key twice names one rollout: served
    r = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        content=body,
        headers=[(name, prefix + key_for("same")), (name, prefix + key_for("same"))],
    )
    assert r.status_code == 200
    assert [rec.header["rollout_id"] for rec in proxy.records()] == ["same"]


def test_a_cr_lf_in_a_header_value_is_refused_and_nothing_is_injected(proxy: ProxyHandle, upstream):
    body = _chat()
    with _connect(proxy) as s:
        s.sendall(
            _post_head(
                f"/r/{key_for('inj')}/v1/chat/completions",
                "x-request-id: a\rx-clawpipe-rollout: run/0/evil",
                f"content-length: {len(body)}",
            )
            + body
        )
        out = read_all(s)
    assert out.startswith(b"HTTP/1.1 400") and b"bare CR" in out
    assert proxy.records() == [] and upstream.requests == []
