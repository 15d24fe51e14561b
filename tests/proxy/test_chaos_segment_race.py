"""Two proxies on one capture folder: one starting (sealing what dead proxies left) while the other opens its next
segment. Between creating the segment and locking it, the new file looks like a dead proxy's; sealed then by
the starting proxy and landed as finished, the records written into it afterwards would never land.

The interleaving is forced: the starting proxy's recovery (and a landing) runs right before the writer's lock.
"""

from __future__ import annotations

import fcntl
import threading
from pathlib import Path
from typing import Any

import httpx

from clawpipe.lake import land, run_sql
from clawpipe.proxy import recovery, segments


def test_a_segment_sealed_between_its_creation_and_its_lock_loses_no_record(
    make_proxy: Any, upstream: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    proxy = make_proxy([upstream.url], capture_dir=cap, segment_max_bytes=3000)
    real_flock = fcntl.flock
    armed = threading.Event()
    raced: list[str] = []

    def flock(fd: int, op: int) -> None:
        if armed.is_set() and threading.current_thread().name.startswith("capture-"):
            armed.clear()
            raced.extend(p.name for p in recovery.recover_dead_segments(cap))  # another proxy starts here
            land(cap, lake)  # and a landing runs before the writer goes on
        real_flock(fd, op)

    monkeypatch.setattr(segments.fcntl, "flock", flock)
    url = f"{proxy.openai_base('r1')}/chat/completions"
    sent = 0
    for i in range(12):
        if i == 2:
            armed.set()  # the next segment opened by rotation meets the race
        r = httpx.post(url, json={"model": "m", "messages": [{"role": "user", "content": f"m{i}"}]}, timeout=10)
        assert r.status_code == 200
        sent += 1
    assert raced, "no segment was opened while armed: lower segment_max_bytes"
    proxy.server.stop()
    land(cap, lake)
    got = run_sql(lake, "select count(distinct call_id) as n from model_calls").to_pylist()[0]["n"]
    assert got == sent, f"{sent - got} answered calls never landed (segments sealed under the writer: {raced})"
