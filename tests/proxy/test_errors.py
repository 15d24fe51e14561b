"""Bad input and failing upstreams: the error shapes harnesses see, and the failed calls captured."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from clawpipe.net import free_port
from tests.proxy.conftest import SECRET, ProxyHandle, key_for
from tests.support.upstream import ScriptedUpstream, say


@pytest.mark.parametrize(
    "how",
    ["missing", "forged_mac", "other_secret", "garbage_path_key", "bearer_forged"],
)
def test_unknown_forged_or_missing_key_is_401_and_nothing_forwarded(proxy: ProxyHandle, upstream, how):
    from clawpipe.keys import mint_key

    good = key_for("r1")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    url, headers = f"{proxy.url}/v1/chat/completions", {}
    if how == "forged_mac":
        url = f"{proxy.url}/r/{good[:-4]}AAAA/v1/chat/completions"
    elif how == "other_secret":
        other = mint_key(b"not-" + SECRET, run_id="run1", iteration=0, rollout_id="r1")
        url = f"{proxy.url}/r/{other}/v1/chat/completions"
    elif how == "garbage_path_key":
        url = f"{proxy.url}/r/hello/v1/chat/completions"
    elif how == "bearer_forged":
        headers = {"authorization": "Bearer cp1.AAAA.BBBB"}
    r = httpx.post(url, json=body, headers=headers)
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert upstream.requests == [] and proxy.records() == []
    assert proxy.server.stats["unauthorized"] == 1


def test_sdk_sees_authentication_errors(proxy: ProxyHandle, upstream):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-nope", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=proxy.url, api_key="nope", max_retries=0).messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
    assert upstream.requests == []


def test_malformed_json_is_400_and_captured(proxy: ProxyHandle, upstream):
    r = httpx.post(f"{proxy.openai_base('rb')}/chat/completions", content=b'{"model": "m", "messages": [')
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r2 = httpx.post(f"{proxy.anthropic_base('rb')}/v1/messages", content=b"[1, 2]")
    assert r2.status_code == 400 and r2.json()["type"] == "error"  # Anthropic shape on /v1/messages
    recs = proxy.records()
    assert [(x.header["http_status"], x.header["status"]) for x in recs] == [(400, "http_error")] * 2
    assert recs[0].request == b'{"model": "m", "messages": ['
    assert recs[0].header["rollout_id"] == "rb" and "not valid JSON" in recs[0].header["error"]
    assert upstream.requests == []


def test_body_over_limit_is_413_and_captured(make_proxy, upstream):
    proxy = make_proxy([upstream.url], max_body_bytes=1000)
    with pytest.raises(openai.APIStatusError) as err:
        openai.OpenAI(base_url=proxy.openai_base("rl"), api_key="x", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x" * 5000}]
        )
    assert err.value.status_code == 413
    (rec,) = proxy.records()
    assert rec.header["http_status"] == 413 and rec.header["rollout_id"] == "rl"
    assert upstream.requests == []


def test_unknown_path_is_404_and_captured(proxy: ProxyHandle, upstream):
    r = httpx.post(f"{proxy.openai_base('rn')}/embeddings", json={"input": "x"})
    message = r.json()["error"]["message"]
    assert r.status_code == 404 and "unknown endpoint POST /v1/embeddings" in message
    # the message names every route, the stored-response ones with their id (before: the plain paths only)
    assert "GET /v1/responses/{id}/input_items" in message and "POST /v1/chat/completions" in message
    (rec,) = proxy.records()
    assert rec.header["http_status"] == 404 and rec.header["path"] == "/v1/embeddings"


def test_every_route_an_error_names_is_served() -> None:
    from clawpipe.proxy.routes import ROUTE_NAMES, served_path

    for name in ROUTE_NAMES:
        method, path = name.split(" ", 1)
        assert served_path(method, path.replace("{model}", "m-1").replace("{id}", "resp_1"))[1], name


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/chat/completions", "POST"),  # a health probe, or a browser, on the model endpoint
        ("PUT", "/v1/responses", "POST"),
        ("DELETE", "/v1/messages", "POST"),
        ("POST", "/v1/models", "GET"),
        ("GET", "/chat/completions", "POST"),  # a base URL given without /v1
        ("GET", "/v1//completions", "POST"),  # one ending in "/", joined by concatenation
    ],
)
def test_a_served_path_asked_with_another_method_is_a_405_naming_the_allowed_one(
    proxy: ProxyHandle, upstream, method: str, path: str, allow: str
):
    """Before: a 404 "unknown endpoint", which sends a user looking for a wrong URL rather than a wrong method."""
    r = httpx.request(method, f"{proxy.anthropic_base('rm')}{path}", content=b"{}")
    assert r.status_code == 405 and r.headers["allow"] == allow, (r.status_code, r.headers)
    msg = r.json()["error"]["message"]
    assert f"{method} is not allowed on" in msg and f"send it as {allow}" in msg
    if "messages" in path:  # in the shape of the API the path belongs to
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    (rec,) = proxy.records()
    assert rec.header["http_status"] == 405 and rec.header["method"] == method and rec.header["api"] == "unknown"
    assert upstream.requests == []


def test_upstream_down_is_502_and_captured(make_proxy):
    proxy = make_proxy([f"http://127.0.0.1:{free_port()}"])
    client = openai.OpenAI(base_url=proxy.openai_base("rd"), api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 502
    (rec,) = proxy.records()
    assert (rec.header["http_status"], rec.header["status"]) == (502, "upstream_error")
    assert "unreachable" in rec.header["error"]


def test_upstream_silence_is_504_and_captured(make_proxy, upstream: ScriptedUpstream):
    proxy = make_proxy([upstream.url], upstream_timeout_s=0.4)
    upstream.hang = True
    t0 = time.monotonic()
    with pytest.raises(anthropic.APIStatusError) as err:
        anthropic.Anthropic(base_url=proxy.anthropic_base("rt"), api_key="x", max_retries=0).messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
    assert err.value.status_code == 504 and time.monotonic() - t0 < 5
    (rec,) = proxy.records()
    assert (rec.header["http_status"], rec.header["status"]) == (504, "upstream_error")
    assert len(upstream.requests) == 1


def test_upstream_error_status_passes_through(proxy: ProxyHandle, upstream: ScriptedUpstream):
    upstream.error_status = 500
    with pytest.raises(openai.InternalServerError):
        openai.OpenAI(base_url=proxy.openai_base("re"), api_key="x", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}]
        )
    (rec,) = proxy.records()
    assert (rec.header["http_status"], rec.header["status"]) == (500, "http_error")
    assert b"scripted upstream error" in rec.response


def test_client_disconnect_mid_stream_cancels_upstream_and_captures_partial(proxy: ProxyHandle, upstream):
    upstream.chunk_delay_s = 0.05
    upstream.chunk_chars = 1
    upstream.push(say("a fairly long answer that streams slowly, one character at a time"))
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    with httpx.stream("POST", f"{proxy.openai_base('rc')}/chat/completions", json=body) as r:
        it = r.iter_raw()
        first = next(it)
        assert b"data:" in first
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not proxy.records():
        time.sleep(0.05)
    (rec,) = proxy.records()
    assert rec.header["status"] == "cancelled" and rec.header["http_status"] == 200
    assert rec.response.startswith(b"data: ") and b"[DONE]" not in rec.response
    while time.monotonic() < deadline and upstream.cancelled == 0:
        time.sleep(0.05)
    assert upstream.cancelled == 1  # the upstream request was cut, not run to completion
    assert proxy.server.in_flight == 0


def test_large_refused_body_still_gets_a_clean_413(make_proxy, upstream):
    proxy = make_proxy([upstream.url], max_body_bytes=1000)
    big = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * (4 << 20) + b'"}]}'
    r = httpx.post(f"{proxy.openai_base('rl')}/chat/completions", content=big, timeout=10)
    assert r.status_code == 413 and "exceeds the proxy limit" in r.json()["error"]["message"]
    assert upstream.requests == []


def test_base_url_without_v1_is_accepted(proxy: ProxyHandle, upstream):
    base = proxy.openai_base("r1").removesuffix("/v1")
    r = httpx.post(f"{base}/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200
    assert proxy.records()[0].header["path"] == "/v1/chat/completions"
    assert upstream.requests[0].path == "/v1/chat/completions"


@pytest.mark.parametrize("joined", ["/v1//chat/completions", "//chat/completions", "/v1///chat//completions"])
def test_a_base_url_ending_in_a_slash_joined_by_concatenation_is_served(proxy: ProxyHandle, upstream, joined: str):
    """``f"{base}/chat/completions"`` with a base URL ending in "/" doubles a slash: the call is still a chat
    call, forwarded and captured on its tidy path."""
    base = proxy.openai_base("r2").removesuffix("/v1")
    r = httpx.post(base + joined, json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200, r.text
    (rec,) = proxy.records()
    assert rec.header["path"] == "/v1/chat/completions" and rec.header["api"] == "chat"
    assert upstream.requests[0].path == "/v1/chat/completions"


def test_upstream_dying_mid_stream_truncates_the_stream_and_is_captured(proxy: ProxyHandle, upstream):
    upstream.chunk_chars = 2
    upstream.push(say("this answer will be cut off"))
    upstream.cut_after_events = 3
    client = openai.OpenAI(base_url=proxy.openai_base("rx"), api_key="x", max_retries=0)
    got = []
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for chunk in client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True
        ):
            got.append(chunk)
    (rec,) = proxy.records()
    assert rec.header["status"] == "upstream_error" and rec.header["http_status"] == 200
    assert rec.response.count(b"data: ") == 3 and b"[DONE]" not in rec.response


def test_chunked_request_body_is_accepted(proxy: ProxyHandle, upstream):
    payload = b'{"model": "m", "messages": [{"role": "user", "content": "chunked hello"}]}'

    def pieces():
        for i in range(0, len(payload), 10):
            yield payload[i : i + 10]

    r = httpx.post(f"{proxy.openai_base('rch')}/chat/completions", content=pieces())
    assert r.status_code == 200
    (rec,) = proxy.records()
    assert rec.request == payload and upstream.requests[0].json()["messages"][0]["content"] == "chunked hello"


def test_a_call_that_could_not_be_recorded_is_507_and_counted_as_a_capture_failure(
    proxy: ProxyHandle, upstream: ScriptedUpstream
) -> None:
    from clawpipe.errors import CaptureError

    upstream.push(say("fine"), say("lost"))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{proxy.openai_base('rc')}/chat/completions", json=body).status_code == 200
    # every later write fails (a real full disk: tests/proxy/test_exhaustion.py)
    proxy.server.writer._write = lambda frames: (0, CaptureError("No space left on device"))  # type: ignore[method-assign]
    r = httpx.post(f"{proxy.openai_base('rc')}/chat/completions", json=body)
    assert r.status_code == 507 and "could not record this call" in r.text and "No space left" in r.text
    stats = httpx.get(
        f"{proxy.url}/admin/stats", headers={"authorization": f"Bearer {proxy.server.config.admin_token}"}
    )
    assert (stats.json()["capture_failures"], stats.json()["calls"]) == (1, 2)


def test_a_proxy_that_cannot_bind_leaves_no_capture_writer_running(tmp_path, proxy: ProxyHandle, upstream) -> None:
    import threading

    from clawpipe.proxy.server import ProxyServer
    from tests.proxy.conftest import ADMIN

    cap = tmp_path / "second"
    second = ProxyServer(
        upstreams=[upstream.url], capture_dir=cap, secret=SECRET, admin_token=ADMIN, port=proxy.server.port
    )
    with pytest.raises(OSError):  # the first proxy holds the port
        second.start()
    assert not [t for t in threading.enumerate() if t.name == f"capture-{second.instance}"]
    assert list(cap.glob("*.open")) == []  # no segment left open (and locked) by a writer nobody stops
