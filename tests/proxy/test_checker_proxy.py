"""Large bodies through a real proxy: many at once from many connections, a client gone while its body waits
for the worker, and proxies started and stopped with no worker left behind."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import pytest

from clawpipe.proxy.body import read_call_body
from tests.proxy.conftest import ProxyHandle
from tests.proxy.test_body_checker import _dense_body, _path, _post, _send_raw


def _big_chat(tag: str, mib: int = 2) -> bytes:
    """A valid chat body of about `mib` MiB, its content naming `tag`; it asks for a stream or not by tag."""
    body = {
        "model": f"m-{tag}",
        "messages": [{"role": "user", "content": f"{tag} " + "x" * (mib << 20)}],
        "stream": int(tag.rsplit("-", 1)[1]) % 2 == 0,
    }
    return json.dumps(body).encode()


@pytest.mark.slow
def test_twenty_concurrent_large_bodies_are_each_captured_once_with_their_own_changes(
    proxy: ProxyHandle, upstream: Any
) -> None:
    bodies = {f"big-{i}": _big_chat(f"big-{i}") for i in range(20)}
    got: dict[str, list[bytes]] = {k: [] for k in bodies}
    threads = [threading.Thread(target=_send_raw, args=(proxy, _path(proxy, k), b, got[k])) for k, b in bodies.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(len(v) == 1 and v[0].startswith(b"HTTP/1.1 200") for v in got.values()), {
        k: v[0][:80] if v else None for k, v in got.items()
    }
    records = proxy.records()
    assert sorted(r.header["rollout_id"] for r in records) == sorted(bodies)
    for rec in records:
        rollout = rec.header["rollout_id"]
        want = read_call_body("chat", bodies[rollout], None)
        assert rec.header["model"] == f"m-{rollout}" and rec.header["stream"] == want.stream
        assert want.request_changes is not None
        assert rec.header["request_changes"] == json.loads(bytes(want.request_changes))
        assert rec.request == bodies[rollout] and rec.header["status"] == "ok"
    assert proxy.server.snapshot_stats()["bodies_checked_in_worker"] == 20


def test_a_client_gone_while_its_body_waits_for_the_worker_is_captured_cancelled_once(
    proxy: ProxyHandle, upstream: Any
) -> None:
    """A 24 MiB body holds the worker; meanwhile a client sends a 2 MiB body and leaves. Its call is captured
    once, never sent to the upstream (nobody waits for the answer), and the call after it gets its own."""
    held = _dense_body(24) + b"x"  # refused only after the whole parse, and never parsed by the upstream
    held_out: list[bytes] = []
    holder = threading.Thread(target=_send_raw, args=(proxy, _path(proxy, "held"), held, held_out))
    holder.start()
    time.sleep(0.3)
    gone = _big_chat("gone-1")
    with _post(proxy, _path(proxy, "gone"), gone, close=False):
        pass  # the client leaves once its body is sent
    holder.join()
    after: list[bytes] = []
    _send_raw(proxy, _path(proxy, "after"), _big_chat("after-1"), after)
    assert held_out[0].startswith(b"HTTP/1.1 400") and after[0].startswith(b"HTTP/1.1 200")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(proxy.records()) < 3:
        time.sleep(0.05)
    by_rollout: dict[str, list[Any]] = {}
    for rec in proxy.records():
        by_rollout.setdefault(rec.header["rollout_id"], []).append(rec)
    assert sorted(by_rollout) == ["after", "gone", "held"]
    (gone_rec,) = by_rollout["gone"]
    assert gone_rec.header["status"] == "cancelled" and gone_rec.header["model"] == "m-gone-1"
    assert not any(b"m-gone-1" in r.body for r in upstream.requests)  # not sent on: nobody waits for its answer
    (after_rec,) = by_rollout["after"]
    assert after_rec.header["model"] == "m-after-1" and after_rec.header["status"] == "ok"


def _children() -> list[int]:
    me, out = os.getpid(), []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                out.append(int(name))
    return out


@pytest.mark.slow
def test_twenty_proxies_started_and_stopped_leave_no_worker(make_proxy: Any, upstream: Any) -> None:
    before = set(_children())
    for i in range(20):
        proxy = make_proxy([upstream.url])
        out: list[bytes] = []
        _send_raw(proxy, _path(proxy, f"p{i}"), _big_chat(f"p-{i}"), out)
        assert out[0].startswith(b"HTTP/1.1 200")
        assert proxy.server.snapshot_stats()["bodies_checked_in_worker"] == 1
        proxy.server.stop(drain_timeout_s=5)
        assert set(_children()) - before == set(), f"proxy {i} left a child process"
