"""curl as a new user types it: ``-d`` without a JSON content type (curl then says form-urlencoded), a body whose
content type is text or missing, ``--compressed``. The upstream gets each body labelled as the JSON the proxy
read it as, and each call is captured once."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.proxy.conftest import ProxyHandle
from tests.support.upstream import ScriptedUpstream

CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]})


def _curl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["curl", "-sS", "-m", "10", *args], capture_output=True, text=True, timeout=30, check=True)


@pytest.mark.parametrize(
    "header",
    [
        None,  # curl -d: application/x-www-form-urlencoded
        "content-type: text/plain;charset=UTF-8",  # what fetch says of a string body
        "content-type:",  # curl sends none
        "content-type: application/json; charset=utf-8",
    ],
)
def test_a_json_body_reaches_the_upstream_labelled_json_whatever_the_client_said(
    proxy: ProxyHandle, upstream: ScriptedUpstream, header: str | None
):
    """Servers built on FastAPI (vLLM's among them) read a body as JSON only under a JSON content type: the
    call forwarded as form-urlencoded or text was refused there (422), though the proxy had read it as JSON."""
    out = _curl(*(["-H", header] if header else []), "-d", CHAT, f"{proxy.openai_base('curl')}/chat/completions")
    assert json.loads(out.stdout)["choices"][0]["message"]["content"] == "ok"
    (seen,) = upstream.model_requests()
    assert seen.headers["content-type"] == "application/json"
    (rec,) = proxy.records()
    assert rec.request == CHAT.encode() and rec.header["status"] == "ok"


def test_models_calls_keep_their_headers(proxy: ProxyHandle, upstream: ScriptedUpstream):
    _curl("-H", "content-type: text/plain", f"{proxy.openai_base('curl')}/models")
    (seen,) = [r for r in upstream.requests if r.path.endswith("/models")]
    assert seen.headers["content-type"] == "text/plain"


def test_curl_compressed_gets_an_uncoded_answer_and_the_call_is_captured_once(
    proxy: ProxyHandle, upstream: ScriptedUpstream
):
    out = _curl(
        "--compressed",
        "-D",
        "/dev/stderr",
        "-H",
        "content-type: application/json",
        "-d",
        CHAT,
        f"{proxy.openai_base('curl')}/chat/completions",
    )
    assert out.stderr.startswith("HTTP/1.1 200") and "content-encoding" not in out.stderr.lower()
    assert json.loads(out.stdout)["choices"][0]["message"]["content"] == "ok"
    assert upstream.model_requests()[0].headers["accept-encoding"] == "identity"
    (rec,) = proxy.records()
    assert rec.header["status"] == "ok"
