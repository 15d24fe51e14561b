"""Admin endpoints: token check, health/stats, pause/resume around a weight update, policy_version."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from clawpipe.errors import ConfigError
from clawpipe.proxy import ProxyConfig
from tests.proxy.conftest import ADMIN, ProxyHandle
from tests.support.upstream import ScriptedUpstream

AUTH = {"authorization": f"Bearer {ADMIN}"}


def test_admin_needs_the_admin_token(proxy: ProxyHandle, upstream):
    from tests.proxy.conftest import key_for

    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Bearer {key_for('r1')}"}):
        assert httpx.get(f"{proxy.url}/admin/health", headers=headers).status_code == 401
        assert httpx.post(f"{proxy.url}/admin/pause", headers=headers).status_code == 401
    assert proxy.server.paused is False
    h = httpx.get(f"{proxy.url}/admin/health", headers=AUTH).json()
    assert h["status"] == "ok" and h["upstreams"] == [upstream.url]
    assert httpx.get(f"{proxy.url}/admin/nope", headers=AUTH).status_code == 404


def test_stats_count_calls(proxy: ProxyHandle, upstream):
    client = openai.OpenAI(base_url=proxy.openai_base("r1"), api_key="x", max_retries=0)
    for _ in range(3):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    httpx.post(f"{proxy.url}/v1/chat/completions", json={})
    s = httpx.get(f"{proxy.url}/admin/stats", headers=AUTH).json()
    assert (s["calls"], s["ok"], s["unauthorized"], s["records"]) == (3, 3, 1, 3)
    assert s["rss_bytes"] > 0 and s["segment"].endswith(".open")


def test_pause_drains_in_flight_then_new_calls_wait_and_get_new_version(proxy: ProxyHandle, upstream: ScriptedUpstream):
    upstream.delay_s = 0.3
    client = openai.OpenAI(base_url=proxy.openai_base("r1"), api_key="x", max_retries=0)
    results: dict[str, object] = {}

    def call(name: str) -> None:
        results[name] = client.chat.completions.create(model="m", messages=[{"role": "user", "content": name}])
        results[name + "_t"] = time.monotonic()

    slow = threading.Thread(target=call, args=("inflight",))
    slow.start()
    deadline = time.monotonic() + 10
    while not upstream.requests and time.monotonic() < deadline:  # the call is at the upstream
        time.sleep(0.01)
    r = httpx.post(f"{proxy.url}/admin/pause", headers=AUTH, timeout=10).json()
    assert r == {"paused": True, "drained": True, "in_flight": 0}
    # the pause returned only after the in-flight call completed (and was captured)
    assert [b"inflight" in rec.request for rec in proxy.records()] == [True]
    upstream.delay_s = 0.0
    waiting = threading.Thread(target=call, args=("waiting",))
    waiting.start()
    time.sleep(0.4)
    assert "waiting" not in results  # held at the gate, not failed
    n_before = len(upstream.requests)
    t_resume = time.monotonic()
    r = httpx.post(f"{proxy.url}/admin/resume", headers=AUTH, json={"policy_version": 5}).json()
    assert r == {"paused": False, "policy_version": 5}
    waiting.join(5)
    slow.join(5)
    assert results["waiting_t"] >= t_resume and n_before == 1
    versions = {(r.header["policy_version"]) for r in proxy.records() if b"waiting" in r.request}
    assert versions == {5}


def test_pause_wait_is_bounded(make_proxy, upstream):
    proxy = make_proxy([upstream.url], pause_wait_s=0.3)
    assert httpx.post(f"{proxy.url}/admin/pause", headers=AUTH).json()["drained"] is True
    client = openai.OpenAI(base_url=proxy.openai_base("r1"), api_key="x", max_retries=0)
    try:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("expected 503")
    except openai.APIStatusError as exc:
        assert exc.status_code == 503
    assert upstream.requests == []
    assert proxy.records()[0].header["http_status"] == 503


def test_policy_version_endpoint(proxy: ProxyHandle, upstream):
    assert httpx.get(f"{proxy.url}/admin/policy_version", headers=AUTH).json() == {"policy_version": 0}
    r = httpx.post(f"{proxy.url}/admin/policy_version", headers=AUTH, json={"policy_version": 12})
    assert r.json() == {"policy_version": 12}
    assert httpx.post(f"{proxy.url}/admin/policy_version", headers=AUTH, json={"v": 1}).status_code == 400
    openai.OpenAI(base_url=proxy.openai_base("r1"), api_key="x", max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}]
    )
    assert proxy.records()[0].header["policy_version"] == 12


def test_python_pause_resume_api(proxy: ProxyHandle, upstream):
    assert proxy.server.pause(wait_s=1) == {"paused": True, "drained": True, "in_flight": 0}
    assert httpx.get(f"{proxy.url}/admin/health", headers=AUTH).json()["paused"] is True
    assert proxy.server.resume(policy_version=9) == {"paused": False, "policy_version": 9}
    openai.OpenAI(base_url=proxy.openai_base("r1"), api_key="x", max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}]
    )
    assert proxy.records()[0].header["policy_version"] == 9


def test_pause_reports_undrained_when_a_call_outlives_the_wait(proxy: ProxyHandle, upstream: ScriptedUpstream):
    upstream.delay_s = 1.0
    client = openai.OpenAI(base_url=proxy.openai_base("r1"), api_key="x", max_retries=0)
    t = threading.Thread(
        target=lambda: client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    )
    t.start()
    deadline = time.monotonic() + 10
    while not upstream.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    r = httpx.post(f"{proxy.url}/admin/pause", headers=AUTH, json={"wait_s": 0.1}).json()
    assert r == {"paused": True, "drained": False, "in_flight": 1}
    httpx.post(f"{proxy.url}/admin/resume", headers=AUTH)
    t.join(10)
    assert proxy.records()[0].header["status"] == "ok"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/admin/policy_version", {"policy_version": 10**30}),
        ("/admin/policy_version", {"policy_version": 2**31}),
        ("/admin/policy_version", {"policy_version": -1}),
        ("/admin/resume", {"policy_version": 2**31}),
        ("/admin/resume", {"policy_version": -5}),
        ("/admin/pause", {"wait_s": 1e9}),
        ("/admin/pause", {"wait_s": -1}),
    ],
)
def test_out_of_range_admin_values_are_400_and_change_nothing(proxy: ProxyHandle, path: str, body: dict):
    """One bound for policy_version wherever the proxy takes it, [0, 2**31 - 1], so every captured record lands."""
    r = httpx.post(f"{proxy.url}{path}", json=body, headers=AUTH, timeout=10)
    assert r.status_code == 400 and ("2147483647" in r.text or "3600" in r.text)
    assert proxy.server.policy_version == 0 and not proxy.server.paused


def test_infinite_or_nan_wait_is_400(proxy: ProxyHandle):
    for bad in ('{"wait_s": Infinity}', '{"wait_s": NaN}'):
        r = httpx.post(f"{proxy.url}/admin/pause", content=bad, headers=AUTH, timeout=10)
        assert r.status_code == 400 and not proxy.server.paused


def test_the_largest_policy_version_is_accepted_and_stamped(proxy: ProxyHandle, upstream):
    r = httpx.post(f"{proxy.url}/admin/policy_version", json={"policy_version": 2**31 - 1}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"policy_version": 2**31 - 1}
    openai.OpenAI(base_url=proxy.openai_base("v"), api_key="x", max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}]
    )
    (rec,) = proxy.records()
    assert rec.header["policy_version"] == 2**31 - 1


def test_out_of_range_policy_versions_are_refused_at_start(tmp_path):
    for bad in (-1, 2**31, True):
        with pytest.raises(ConfigError, match="policy_version"):
            ProxyConfig(upstreams=["http://127.0.0.1:1"], capture_dir=tmp_path, policy_version=bad)


def test_admin_tokens_and_key_macs_are_compared_in_constant_time(proxy: ProxyHandle, upstream, monkeypatch):
    import hmac

    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a, b):
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert httpx.get(f"{proxy.url}/admin/health", headers={"authorization": "Bearer nope"}).status_code == 401
    assert any(b"nope" in bytes(a) for a, _ in seen)
    seen.clear()
    r = httpx.post(f"{proxy.openai_base('fresh-key')}/chat/completions", json={"model": "m", "messages": []})
    assert r.status_code == 200 and seen  # the key's MAC


def test_ready_is_the_probe_a_load_balancer_polls(make_proxy, upstream: ScriptedUpstream):
    """Readiness is 200 while calls can be captured and forwarded, 503 naming why once every upstream is down
    (health, the liveness probe, stays 200); it needs the admin token like every admin endpoint."""
    from clawpipe.net import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    good = make_proxy([upstream.url])
    r = httpx.get(f"{good.url}/admin/ready", headers=AUTH)
    assert r.status_code == 200 and r.json()["ready"] is True and r.json()["upstreams"] == {upstream.url: "up"}
    assert httpx.get(f"{good.url}/admin/ready").status_code == 401

    proxy = make_proxy([dead], replica_backoff_s=60.0)
    assert httpx.get(f"{proxy.url}/admin/ready", headers=AUTH).status_code == 200  # nothing failed yet
    call = httpx.post(f"{proxy.openai_base('r1')}/chat/completions", json={"model": "m", "messages": []}, timeout=10)
    assert call.status_code == 502
    r = httpx.get(f"{proxy.url}/admin/ready", headers=AUTH)
    assert r.status_code == 503
    body = r.json()
    assert body["ready"] is False and body["upstreams"] == {dead: "down"}
    assert any("every upstream is down" in reason for reason in body["reasons"])
    assert httpx.get(f"{proxy.url}/admin/health", headers=AUTH).status_code == 200
