"""The capture proxy SIGKILLed at random moments (also while it starts and seals what its predecessor left) and
started again on the same capture folder under streamed and unstreamed traffic: every call a client got a
whole answer for is captured exactly once, and the segments end sealed with no damaged frame in them.

A seeded RNG picks the moments (``CLAWPIPE_CHAOS_SEED`` reruns one; failures name it).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from clawpipe import capture
from clawpipe.net import free_port
from tests.proxy.conftest import ADMIN, SECRET, key_for
from tests.support.upstream import ScriptedUpstream


def _start(cap: Path, upstream: str, port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "clawpipe", "proxy", "--upstream", upstream, "--port", str(port)]
    cmd += ["--capture-dir", str(cap), "--segment-mb", "0.02"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _client(url: str, t: int, rng: random.Random, stop: threading.Event, answered: set[str]) -> None:
    base = f"{url}/r/{key_for(f'r{t}')}/v1/chat/completions"
    with httpx.Client(timeout=15) as client:
        i = 0
        while not stop.is_set():
            tag = f"t{t}-{i}"
            i += 1
            stream = rng.random() < 0.5
            body = {"model": "m", "messages": [{"role": "user", "content": tag}], "stream": stream}
            try:
                with client.stream("POST", base, json=body) as r:
                    data = b"".join(r.iter_bytes())
            except httpx.HTTPError:
                stop.wait(0.02)
                continue
            if r.status_code == 200 and (b"data: [DONE]" in data if stream else bool(json.loads(data).get("choices"))):
                answered.add(tag)


@pytest.mark.slow
def test_random_kills_and_restarts_capture_each_answered_call_once(tmp_path: Path) -> None:
    seed = int(os.environ.get("CLAWPIPE_CHAOS_SEED") or 5)
    rng = random.Random(seed)
    cap = tmp_path / "cap"
    env = {
        **os.environ,
        "CLAWPIPE_HOME": str(tmp_path / "home"),
        "CLAWPIPE_PROXY_SECRET": SECRET.decode(),
        "CLAWPIPE_ADMIN_TOKEN": ADMIN,
    }
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    answered: set[str] = set()
    stop = threading.Event()
    kills = 0
    with ScriptedUpstream() as up:
        proc = _start(cap, up.url, port, env)
        clients = [
            threading.Thread(target=_client, args=(url, t, random.Random(rng.random()), stop, answered))
            for t in range(6)
        ]
        for c in clients:
            c.start()
        try:
            while kills < 20:
                # from right after the start (recovery of the dead segments) to well into serving
                time.sleep(rng.choice([rng.uniform(0.0, 0.4), rng.uniform(0.5, 1.5)]))
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                kills += 1
                proc = _start(cap, up.url, port, env)
            time.sleep(1.5)  # the last one serves for a while
        finally:
            stop.set()
            for c in clients:
                c.join(30)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
    print(f"chaos seed {seed}: {kills} kills, {len(answered)} calls answered")
    assert proc.returncode == 0, f"seed {seed}: {err.decode()[-2000:]}"
    assert len(answered) >= 50, f"seed {seed}: only {len(answered)} calls answered"
    assert list(cap.glob(f"*{capture.OPEN_SUFFIX}")) == [], f"seed {seed}: a segment was left open"
    tags: list[str] = []
    for seg in sorted(cap.glob(f"*{capture.SEALED_SUFFIX}")):
        for rec in capture.read_segment(seg):
            assert isinstance(rec, capture.CaptureRecord), f"seed {seed}: damage in {seg.name}: {rec}"
            tags.append(json.loads(rec.request)["messages"][0]["content"])
    assert len(tags) == len(set(tags)), f"seed {seed}: a call was captured twice"
    missing = answered - set(tags)
    assert not missing, f"seed {seed}: {len(missing)} answered calls not captured, e.g. {sorted(missing)[:5]}"
