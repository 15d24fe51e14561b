"""Durable capture: group-committed segments, rotation, sealing, torn-tail recovery, kill -9 under load."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from clawpipe import capture
from tests.proxy.conftest import ADMIN, SECRET, key_for, read_captures
from tests.support.upstream import ScriptedUpstream


def _chat(base: str, n: int, rollout: str = "r1") -> None:
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
    for i in range(n):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"{rollout}-{i}"}])


def test_rotation_by_size_and_seal_on_stop(make_proxy, upstream):
    proxy = make_proxy([upstream.url], segment_max_bytes=3000)
    _chat(proxy.openai_base("r1"), 10)
    proxy.server.stop()
    assert list(proxy.capture_dir.glob("*.open")) == []
    sealed = sorted(proxy.capture_dir.glob("*.seg"))
    assert len(sealed) >= 3
    contents = [json.loads(r.request)["messages"][0]["content"] for r in read_captures(proxy.capture_dir)]
    assert sorted(contents) == sorted(f"r1-{i}" for i in range(10))


def test_rotation_by_age_while_running(make_proxy, upstream):
    proxy = make_proxy([upstream.url], segment_max_age_s=0.3)
    _chat(proxy.openai_base("r1"), 1)
    deadline = time.monotonic() + 5
    # rotation renames the old segment, then opens the next one: wait for both steps
    while time.monotonic() < deadline and not (
        list(proxy.capture_dir.glob("*.seg")) and list(proxy.capture_dir.glob("*.open"))
    ):
        time.sleep(0.05)
    (seg,) = proxy.capture_dir.glob("*.seg")
    assert [r.header["rollout_id"] for r in capture.read_segment(seg)] == ["r1"]
    assert len(list(proxy.capture_dir.glob("*.open"))) == 1  # a fresh segment is open for new calls


def test_dead_writer_torn_tail_is_cut_and_sealed_on_start(tmp_path: Path, make_proxy, upstream):
    cap = tmp_path / "cap"
    cap.mkdir()
    dead = cap / "pdead-000000.open"
    frames = [capture.encode_record({"call_id": str(i), "rollout_id": "old"}, b"{}", b"{}") for i in range(2)]
    dead.write_bytes(b"".join(frames) + frames[0][:20])
    proxy = make_proxy([upstream.url], capture_dir=cap)
    assert not dead.exists()
    recs = list(capture.read_segment(cap / "pdead-000000.seg"))
    assert [r.header["call_id"] for r in recs] == ["0", "1"]
    _chat(proxy.openai_base("r1"), 1)
    assert len(read_captures(cap)) == 3


def test_dead_writer_damage_in_the_middle_keeps_every_intact_record(tmp_path: Path, make_proxy, upstream):
    """Recovery on start cuts only the torn tail: records after a damaged one stay and land."""
    cap = tmp_path / "cap"
    cap.mkdir()
    frames = [capture.encode_record({"call_id": str(i), "rollout_id": "old"}, b"{}", b"{}") for i in range(6)]
    damaged = bytearray(frames[2])
    damaged[len(damaged) // 2] ^= 0x10
    torn = capture.encode_record({"call_id": "torn", "rollout_id": "old"}, b"{}", b"{}")[:-2]
    dead = cap / "pdead-000000.open"
    dead.write_bytes(b"".join([*frames[:2], bytes(damaged), *frames[3:]]) + torn)
    make_proxy([upstream.url], capture_dir=cap)
    got = list(capture.read_segment(cap / "pdead-000000.seg"))
    assert [r.header["call_id"] for r in got if isinstance(r, capture.CaptureRecord)] == ["0", "1", "3", "4", "5"]
    assert [r for r in got if not isinstance(r, capture.CaptureRecord)] == [
        (sum(map(len, frames[:2])), "frame checksum mismatch")
    ]
    assert (cap / "pdead-000000.seg").stat().st_size == sum(map(len, frames))  # only the torn tail was cut


def test_live_writers_segment_is_left_alone(tmp_path: Path, make_proxy, upstream):
    cap = tmp_path / "shared"
    a = make_proxy([upstream.url], capture_dir=cap)
    _chat(a.openai_base("ra"), 1)
    (open_a,) = cap.glob("*.open")
    b = make_proxy([upstream.url], capture_dir=cap)
    assert open_a.exists()  # b did not seal a's open segment
    _chat(a.openai_base("ra"), 1)
    _chat(b.openai_base("rb"), 1)
    assert sorted(r.header["rollout_id"] for r in read_captures(cap)) == ["ra", "ra", "rb"]


@pytest.mark.slow
def test_kill_9_under_load_loses_no_answered_call(tmp_path: Path):
    """Every call whose response a client received in full is in the capture exactly once."""
    cap, ready = tmp_path / "cap", tmp_path / "ready"
    env = {
        **os.environ,
        "CLAWPIPE_HOME": str(tmp_path / "home"),
        "CLAWPIPE_PROXY_SECRET": SECRET.decode(),
        "CLAWPIPE_ADMIN_TOKEN": ADMIN,
    }
    with ScriptedUpstream() as up:
        cmd = [sys.executable, "-m", "clawpipe", "proxy", "--upstream", up.url, "--port", "0"]
        cmd += ["--capture-dir", str(cap), "--ready-file", str(ready), "--segment-mb", "0.05"]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 60
            while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.05)
            assert ready.exists(), proc.stderr.read().decode() if proc.poll() is not None else "no ready file"
            url = ready.read_text()
            completed: list[str] = []
            stop = threading.Event()

            def load(t: int) -> None:
                base = f"{url}/r/{key_for(f'k{t}')}/v1/chat/completions"
                with httpx.Client(timeout=10) as client:
                    i = 0
                    while not stop.is_set():
                        tag = f"t{t}-{i}"
                        body = {"model": "m", "messages": [{"role": "user", "content": tag}], "stream": i % 2 == 1}
                        try:
                            with client.stream("POST", base, json=body) as r:
                                data = b"".join(r.iter_bytes())
                            if r.status_code == 200 and (b"[DONE]" in data or data.endswith(b"}")):
                                completed.append(tag)
                        except httpx.HTTPError:
                            return
                        i += 1

            threads = [threading.Thread(target=load, args=(t,)) for t in range(8)]
            for th in threads:
                th.start()
            deadline = time.monotonic() + 60
            while len(completed) < 300 and time.monotonic() < deadline:
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            stop.set()
            for th in threads:
                th.join(15)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            if proc.stderr:
                proc.stderr.close()
    assert len(completed) >= 50, f"only {len(completed)} calls completed before the kill"
    assert list(cap.glob("*.open")), "kill -9 leaves the open segment unsealed"
    tags = [json.loads(r.request)["messages"][0]["content"] for r in read_captures(cap)]
    assert len(tags) == len(set(tags)), "a call was captured twice"
    missing = set(completed) - set(tags)
    assert not missing, f"{len(missing)} answered calls missing from the capture"
    # a restart on the same directory seals the dead segment without losing a record
    from clawpipe.proxy import ProxyServer

    server = ProxyServer(upstreams=["http://127.0.0.1:9"], capture_dir=cap, secret=SECRET, admin_token=ADMIN)
    server.start()
    server.stop()
    assert list(cap.glob("*.open")) == []
    assert sorted(json.loads(r.request)["messages"][0]["content"] for r in read_captures(cap)) == sorted(tags)


def test_response_released_only_after_fsync(make_proxy, upstream, monkeypatch):
    """The non-streamed body, and a stream's end marker, wait for the record's fsync."""
    from clawpipe.proxy import segments

    real = segments.os.fdatasync

    def slow_sync(fd: int) -> None:
        time.sleep(0.4)
        real(fd)

    monkeypatch.setattr(segments.os, "fdatasync", slow_sync)
    upstream.chunk_delay_s = 0.05  # separate reads, so the end marker arrives on its own
    proxy = make_proxy([upstream.url])
    url = f"{proxy.openai_base('r1')}/chat/completions"
    t0 = time.monotonic()
    r = httpx.post(url, json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200 and time.monotonic() - t0 >= 0.4
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    with httpx.stream("POST", url, json=body) as r:
        chunks = [(time.monotonic(), c) for c in r.iter_raw()]
    i_done = next(i for i, (_, c) in enumerate(chunks) if b"[DONE]" in c)
    assert i_done >= 1, "the stream's first bytes were not passed through before the end"
    assert chunks[i_done][0] - chunks[i_done - 1][0] >= 0.35  # the end marker waited for the fsync
    assert len(proxy.records()) == 2
