"""Upstream replicas behind one real proxy, on loopback: load balancing, stickiness, draining, routing around
a failed replica, and when a call is (and is not) sent to a second replica."""

from __future__ import annotations

import threading
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.proxy.conftest import ADMIN, ProxyHandle, key_for
from tests.support.upstream import ScriptedUpstream, say

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
AUTH = {"authorization": f"Bearer {ADMIN}"}


def ids_hashing_to(index: int, n: int, count: int, prefix: str) -> list[str]:
    """Rollout ids that a hash alone would all send to replica ``index`` of ``n``."""
    out: list[str] = []
    i = 0
    while len(out) < count:
        rid = f"{prefix}{i}"
        if zlib.crc32(rid.encode()) % n == index:
            out.append(rid)
        i += 1
    return out


def chat(proxy: ProxyHandle, rollout_id: str, **extra: Any) -> httpx.Response:
    url = f"{proxy.url}/r/{key_for(rollout_id)}/v1/chat/completions"
    return httpx.post(url, json={**CHAT, **extra}, timeout=30)


def together(fn: Any, args: list[Any]) -> list[Any]:
    """Run fn(arg) for every arg in its own thread, all released at once; results in order."""
    out: list[Any] = [None] * len(args)
    gate = threading.Barrier(len(args))

    def run(i: int) -> None:
        gate.wait()
        out[i] = fn(args[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def admin(proxy: ProxyHandle, method: str, path: str, **kw: Any) -> httpx.Response:
    headers = kw.pop("headers", AUTH)
    return httpx.request(method, f"{proxy.url}/admin/replicas{path}", headers=headers, timeout=10, **kw)


def states(proxy: ProxyHandle) -> dict[str, dict[str, Any]]:
    r = admin(proxy, "GET", "")
    assert r.status_code == 200, r.text
    return {row["upstream"]: row for row in r.json()["replicas"]}


@pytest.fixture
def three() -> Iterator[list[ScriptedUpstream]]:
    ups = [ScriptedUpstream().start() for _ in range(3)]
    yield ups
    for u in ups:
        u.stop()


def test_concurrent_rollouts_spread_by_load_not_hash(make_proxy, three: list[ScriptedUpstream]):
    """30 rollouts whose ids all hash to replica 0 arrive at once: the least loaded replica takes each."""
    for u in three:
        u.delay_s = 1.5  # every call is still in flight when the last one arrives
    proxy = make_proxy([u.url for u in three])
    rids = ids_hashing_to(0, 3, 30, "lb")
    answers = together(lambda rid: chat(proxy, rid), rids)
    assert [a.status_code for a in answers] == [200] * 30
    per = Counter(rec.header["upstream"] for rec in proxy.records())
    assert sum(per.values()) == 30
    assert all(8 <= per[u.url] <= 12 for u in three), per  # a hash alone puts all 30 on replica 0
    assert [len(u.model_requests()) for u in three] == [per[u.url] for u in three]


def test_a_rollout_stays_on_its_replica_while_it_is_healthy(make_proxy, three: list[ScriptedUpstream]):
    for u in three:
        u.delay_s = 0.05
    proxy = make_proxy([u.url for u in three])
    rids = [f"st{i}" for i in range(9)]

    def turns(rid: str) -> list[int]:
        return [chat(proxy, rid).status_code for _ in range(4)]

    assert together(turns, rids) == [[200] * 4] * 9
    where: dict[str, set[str]] = defaultdict(set)
    for rec in proxy.records():
        where[rec.header["rollout_id"]].add(rec.header["upstream"])
    assert len(proxy.records()) == 36
    assert all(len(v) == 1 for v in where.values()), where  # 4 turns, one replica each
    assert {next(iter(v)) for v in where.values()} == {u.url for u in three}  # load still spread


def test_a_drained_replica_takes_no_new_calls_while_its_in_flight_call_finishes(
    make_proxy, three: list[ScriptedUpstream]
):
    proxy = make_proxy([u.url for u in three])
    first = three[0]
    b, a, *fresh = ids_hashing_to(0, 3, 8, "dr")
    assert chat(proxy, b).status_code == 200  # rollout b now sticks to replica 0
    first.delay_s = 1.5
    slow: list[httpx.Response] = []
    t = threading.Thread(target=lambda: slow.append(chat(proxy, a)))
    t.start()
    deadline = time.monotonic() + 10
    while len(first.model_requests()) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    r = admin(proxy, "POST", "/drain", json={"upstream": first.url + "/"})
    assert r.status_code == 200 and r.json()["state"] == "draining" and r.json()["in_flight"] == 1, r.text
    assert states(proxy)[first.url]["in_flight"] == 1
    moved = [chat(proxy, rid) for rid in [b, *fresh[:5]]]  # b was sticky to replica 0; the rest hash to it
    assert [m.status_code for m in moved] == [200] * 6
    t.join(20)
    assert slow[0].status_code == 200  # the in-flight call finished normally
    assert len(first.model_requests()) == 2  # b's first call and a's: nothing new after the drain
    recs = {(r.header["rollout_id"], r.header["seq"]): r.header for r in proxy.records()}
    assert recs[(a, 0)]["upstream"] == first.url and recs[(a, 0)]["status"] == "ok"
    assert all(recs[(rid, 0)]["upstream"] != first.url for rid in fresh[:5])
    moved_to = recs[(b, 1)]["upstream"]
    assert moved_to != first.url
    assert states(proxy)[first.url] | {"down_for_s": 0} == {
        "upstream": first.url,
        "state": "draining",
        "in_flight": 0,
        "calls": 2,
        "errors": 0,
        "last_error": None,
        "down_for_s": 0,
    }
    r = admin(proxy, "POST", "/undrain", json={"upstream": first.url})
    assert r.status_code == 200 and r.json()["state"] == "up"
    first.delay_s = 0
    assert chat(proxy, fresh[5]).status_code == 200  # back in rotation: an idle tie goes by hash, to it
    assert chat(proxy, b).status_code == 200
    recs = {(r.header["rollout_id"], r.header["seq"]): r.header for r in proxy.records()}
    assert recs[(fresh[5], 0)]["upstream"] == first.url
    assert recs[(b, 2)]["upstream"] == moved_to  # b stays where it moved


def test_every_replica_drained_is_a_captured_503(make_proxy, upstream: ScriptedUpstream):
    proxy = make_proxy([upstream.url])
    assert admin(proxy, "POST", "/drain", json={"upstream": upstream.url}).status_code == 200
    r = chat(proxy, "alldrained")
    assert r.status_code == 503 and "undrain" in r.json()["error"]["message"]
    (rec,) = proxy.records()
    assert rec.header["http_status"] == 503 and upstream.model_requests() == []


@pytest.mark.parametrize(
    "kw, status, words",
    [
        ({"json": {"upstream": "http://127.0.0.1:1"}}, 400, "unknown or missing upstream"),
        ({"json": {"upstream": 5}}, 400, "unknown or missing upstream"),
        ({"json": ["x"]}, 400, "unknown or missing upstream"),
        ({"content": b"{nope"}, 400, "not JSON"),
        ({"json": {"upstream": "U"}, "headers": {"authorization": "Bearer wrong"}}, 401, "admin token"),
    ],
)
def test_bad_drain_requests_are_refused_and_change_nothing(make_proxy, upstream, kw, status, words):
    proxy = make_proxy([upstream.url])
    if kw.get("json") == {"upstream": "U"}:
        kw["json"] = {"upstream": upstream.url}  # right upstream, wrong token
    r = admin(proxy, "POST", "/drain", **kw)
    assert r.status_code == status and words in r.json()["error"]["message"], r.text
    if status == 400:
        assert upstream.url in r.json()["error"]["message"]  # says which upstreams exist
    assert states(proxy)[upstream.url]["state"] == "up"
    assert chat(proxy, "still").status_code == 200


@pytest.mark.slow
def test_a_killed_replica_is_routed_around_and_every_call_captured_once(make_proxy, three: list[ScriptedUpstream]):
    proxy = make_proxy([u.url for u in three])
    rids = [f"k{i}" for i in range(12)]
    assert [r.status_code for r in together(lambda rid: chat(proxy, rid), rids)] == [200] * 12
    home = {rec.header["rollout_id"]: rec.header["upstream"] for rec in proxy.records()}
    dead = three[1]
    on_dead = [rid for rid, url in home.items() if url == dead.url]
    assert on_dead  # the kill below matters to some rollouts
    dead.stop()
    for _ in range(2):
        assert [r.status_code for r in together(lambda rid: chat(proxy, rid), rids)] == [200] * 12
    recs = proxy.records()
    assert len(recs) == 36 and len({r.header["call_id"] for r in recs}) == 36
    assert sorted((r.header["rollout_id"], r.header["seq"]) for r in recs) == sorted(
        (rid, s) for rid in rids for s in range(3)
    )
    assert all(r.header["status"] == "ok" for r in recs)
    after = [r.header for r in recs if r.header["seq"] > 0]
    assert all(h["upstream"] != dead.url for h in after)
    assert sum(len(u.model_requests()) for u in three) == 36  # no call reached two replicas
    for rid in rids:  # survivors keep their replica; the moved ones stay where they moved
        turns = sorted((h for h in after if h["rollout_id"] == rid), key=lambda h: h["seq"])
        if rid not in on_dead:
            assert {h["upstream"] for h in turns} == {home[rid]}
        else:
            assert turns[0]["upstream"] == turns[1]["upstream"]
    row = states(proxy)[dead.url]
    assert row["state"] == "down" and row["errors"] >= 1 and "unreachable" in row["last_error"]
    assert proxy.server.snapshot_stats()["replica_retries"] >= 1


def test_a_503_before_any_body_is_retried_once_on_another_replica(make_proxy, three: list[ScriptedUpstream]):
    proxy = make_proxy([u.url for u in three])
    (rid,) = ids_hashing_to(0, 3, 1, "e")
    three[0].error_status = 503
    r = chat(proxy, rid)
    assert r.status_code == 200
    (rec,) = proxy.records()
    assert rec.header["status"] == "ok" and rec.header["upstream"] != three[0].url
    assert [len(u.model_requests()) for u in three].count(1) == 2  # the refusing replica and the one that served
    assert states(proxy)[three[0].url]["state"] == "down"


def test_a_500_or_a_stream_cut_after_sending_is_never_sent_again(make_proxy, three: list[ScriptedUpstream]):
    """The upstream may have executed these calls: they end as they are, captured once, on one replica."""
    proxy = make_proxy([u.url for u in three])
    r500, rcut = ids_hashing_to(0, 3, 2, "n")
    three[0].error_status = 500
    assert chat(proxy, r500).status_code == 500
    three[0].error_status = None
    three[0].chunk_chars = 2
    three[0].push(say("this answer will be cut off"))
    three[0].cut_after_events = 3
    with pytest.raises(httpx.HTTPError):
        url = f"{proxy.url}/r/{key_for(rcut)}/v1/chat/completions"
        with httpx.stream("POST", url, json={**CHAT, "stream": True}, timeout=30) as resp:
            for _ in resp.iter_raw():
                pass
    recs = {r.header["rollout_id"]: r.header for r in proxy.records()}
    assert recs[r500]["http_status"] == 500 and recs[r500]["upstream"] == three[0].url
    assert recs[rcut]["status"] == "upstream_error" and recs[rcut]["upstream"] == three[0].url
    assert len(proxy.records()) == 2
    assert [len(u.model_requests()) for u in three] == [2, 0, 0]
    assert proxy.server.snapshot_stats()["replica_retries"] == 0
