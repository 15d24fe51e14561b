"""Attribution: interleaved concurrent rollouts, keys in the path or as the API key, replica stickiness."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import httpx
import openai

from tests.proxy.conftest import ProxyHandle, key_for
from tests.support.upstream import ScriptedUpstream


def test_interleaved_concurrent_rollouts_are_attributed(proxy: ProxyHandle, upstream: ScriptedUpstream):
    upstream.delay_s = 0.01  # keep calls overlapping
    n_rollouts, n_turns = 8, 5

    async def rollout(i: int) -> None:
        if i % 2:
            client = openai.AsyncOpenAI(base_url=proxy.openai_base(f"r{i}", iteration=3), api_key="x", max_retries=0)
        else:  # plain base URL, key as API key (bearer)
            client = openai.AsyncOpenAI(
                base_url=f"{proxy.url}/v1", api_key=key_for(f"r{i}", iteration=3), max_retries=0
            )
        msgs = []
        for t in range(n_turns):
            msgs.append({"role": "user", "content": f"rollout {i} turn {t}"})
            r = await client.chat.completions.create(model="m", messages=msgs, stream=(t % 2 == 1))
            if t % 2 == 1:
                text = "".join([c.choices[0].delta.content or "" async for c in r if c.choices])
            else:
                text = r.choices[0].message.content
            msgs.append({"role": "assistant", "content": text})
        await client.close()

    async def main() -> None:
        await asyncio.gather(*(rollout(i) for i in range(n_rollouts)))

    asyncio.run(main())
    recs = proxy.records()
    assert len(recs) == n_rollouts * n_turns
    seqs = defaultdict(list)
    for rec in recs:
        h = rec.header
        last = json.loads(rec.request)["messages"][-1]["content"]
        assert last.startswith(f"rollout {h['rollout_id'][1:]} ")  # content matches the key's rollout
        assert (h["run_id"], h["iteration"]) == ("run1", 3)
        seqs[h["rollout_id"]].append((h["seq"], int(last.split()[-1])))
    assert len({r.header["call_id"] for r in recs}) == len(recs)
    for pairs in seqs.values():
        assert sorted(pairs) == [(t, t) for t in range(n_turns)]  # seq = arrival order within the rollout


def test_path_key_wins_over_bearer(proxy: ProxyHandle, upstream):
    r = httpx.post(
        f"{proxy.openai_base('path-one')}/chat/completions",
        headers={"authorization": f"Bearer {key_for('bearer-one')}"},
        json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 200
    assert proxy.records()[0].header["rollout_id"] == "path-one"
    assert "authorization" not in upstream.requests[0].headers


def test_replicas_sticky_per_rollout_with_failover(make_proxy):
    ups = [ScriptedUpstream().start(), ScriptedUpstream().start()]
    try:
        proxy = make_proxy([u.url for u in ups])
        clients = {
            f"s{i}": openai.OpenAI(base_url=proxy.openai_base(f"s{i}"), api_key="x", max_retries=0) for i in range(12)
        }
        for _ in range(3):
            for c in clients.values():
                c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        where = defaultdict(set)
        for rec in proxy.records():
            where[rec.header["rollout_id"]].add(rec.header["upstream"])
        assert all(len(v) == 1 for v in where.values())  # each rollout sticks to one replica
        assert {next(iter(v)) for v in where.values()} == {u.url for u in ups}  # both replicas used
        ups[0].stop()
        for c in clients.values():
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        last = proxy.records()[-12:]
        assert all(r.header["status"] == "ok" and r.header["upstream"] == ups[1].url for r in last)
    finally:
        for u in ups:
            u.stop()
