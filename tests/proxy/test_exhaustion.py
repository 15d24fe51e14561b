"""The capture proxy when its machine runs out: a full capture disk (a small tmpfs mounted as the capture dir).

A call whose record could not be written is never answered as captured (507 naming the cause, or a stream
left unterminated); no torn frame stays between intact ones; capture resumes by itself once space is freed,
and the health endpoint says when it is failing; landing afterwards gets every answered call exactly once.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from clawpipe import capture
from clawpipe.lake import land, run_sql
from tests.proxy.conftest import ADMIN, ProxyHandle, read_captures
from tests.support.disk import fill, small_disk
from tests.support.upstream import ScriptedUpstream, say

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")

AUTH = {"authorization": f"Bearer {ADMIN}"}


def chat(content: str, stream: bool = False) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "stream": stream}


def call(client: httpx.Client, base: str, content: str, stream: bool) -> tuple[int, str]:
    """(status, body) of one call; a stream cut before its end is status -1."""
    url = f"{base}/chat/completions"
    if not stream:
        r = client.post(url, json=chat(content))
        return r.status_code, r.text
    try:
        with client.stream("POST", url, json=chat(content, stream=True)) as r:
            body = b"".join(r.iter_bytes()).decode()
            return r.status_code, body
    except httpx.RemoteProtocolError as exc:
        return -1, str(exc)


def health(proxy: ProxyHandle) -> dict[str, object]:
    r = httpx.get(f"{proxy.url}/admin/health", headers=AUTH)
    assert r.status_code == 200
    return r.json()


def wait_healthy(proxy: ProxyHandle, timeout_s: float = 10.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while True:
        h = health(proxy)
        if h["status"] == "ok" or time.monotonic() > deadline:
            return h
        time.sleep(0.1)


@pytest.mark.slow
def test_a_full_capture_disk_fails_calls_clearly_and_capture_resumes_once_space_is_freed(
    tmp_path: Path, make_proxy
) -> None:
    up = ScriptedUpstream(default=say("word " * 40)).start()
    try:
        with small_disk(tmp_path / "cap", 1024) as cap:
            proxy = make_proxy([up.url], capture_dir=cap, segment_max_age_s=0)
            base = proxy.openai_base("rfull")
            answered: list[str] = []
            refused: list[tuple[int, str]] = []
            with httpx.Client(timeout=30) as client:
                assert call(client, base, "call -1", stream=False)[0] == 200
                answered.append("call -1")
                record_size = proxy.server.writer.bytes_written
                filler = fill(cap, 5 * record_size)  # room for a few records, then the disk is full mid-traffic
                for i in range(24):
                    status, body = call(client, base, f"call {i}", stream=i % 2 == 1)
                    (answered if status == 200 else refused).append(f"call {i}" if status == 200 else (status, body))
                # some calls went through, then the disk filled: the rest were refused, none as captured
                assert answered and refused
                assert {s for s, _ in refused} <= {507, -1}
                assert 507 in {s for s, _ in refused} and -1 in {s for s, _ in refused}
                first_507 = next(b for s, b in refused if s == 507)
                assert "No space left on device" in first_507 and "bytes free" in first_507
                assert "not captured" in first_507
                h = health(proxy)
                assert h["status"] == "capture_failing"
                assert "No space left on device" in str(h["capture"]["error"])  # type: ignore[index]
                ready = httpx.get(f"{proxy.url}/admin/ready", headers=AUTH)  # a load balancer takes it out
                assert ready.status_code == 503 and "capture failing" in ready.json()["reasons"][0]
                # every record on the full disk is intact (read_captures fails on a damaged frame)
                assert sorted(_contents(proxy.records())) == sorted(answered)

                filler.unlink()  # space is freed: capture resumes with no restart and no call needed
                h = wait_healthy(proxy)
                assert h["status"] == "ok" and h["capture"]["ok"] is True  # type: ignore[index]
                assert httpx.get(f"{proxy.url}/admin/ready", headers=AUTH).status_code == 200
                for i in range(24, 28):
                    status, _ = call(client, base, f"call {i}", stream=i % 2 == 1)
                    assert status == 200
                    answered.append(f"call {i}")
            proxy.server.stop(drain_timeout_s=5)
            assert sorted(_contents(read_captures(cap))) == sorted(answered)
            lake = tmp_path / "lake"
            report = land(cap, lake)
            assert report.rejects == 0 and report.calls == len(answered)
            got = run_sql(lake, "select count(*) as n, count(distinct call_id) as d from model_calls").to_pylist()
            assert got == [{"n": len(answered), "d": len(answered)}]
            assert land(cap, lake).calls == 0  # and once only
    finally:
        up.stop()


def _contents(records: list[capture.CaptureRecord]) -> list[str]:
    import json

    return [json.loads(r.request)["messages"][0]["content"] for r in records]


def test_a_record_that_cannot_be_written_is_507_with_the_connection_kept(
    tmp_path: Path, make_proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 507 keeps the connection usable: a client reusing it gets the next answer, not a reset."""
    up = ScriptedUpstream(default=say("word " * 40)).start()  # a record over a page: it needs a new block
    try:
        with small_disk(tmp_path / "cap", 64) as cap:
            proxy = make_proxy([up.url], capture_dir=cap)
            base = proxy.openai_base("rkeep")
            with httpx.Client(timeout=30) as client:
                assert call(client, base, "first", stream=False)[0] == 200
                filler = fill(cap, 0)
                status, body = call(client, base, "second", stream=False)
                assert status == 507 and "could not record this call" in body
                filler.unlink()
                assert call(client, base, "third", stream=False)[0] == 200  # on the same pooled connection
            assert sorted(_contents(proxy.records())) == ["first", "third"]
    finally:
        up.stop()


def test_out_of_inodes_a_segment_that_cannot_rotate_keeps_taking_records(tmp_path: Path, make_proxy) -> None:
    """No new segment can be made (the filesystem holds no more files): the open one goes on past its size
    limit instead of every later call failing."""
    up = ScriptedUpstream(default=say("ok")).start()
    cap = tmp_path / "cap"
    cap.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=2", "tmpfs", str(cap)], check=True)
    try:
        proxy = make_proxy([up.url], capture_dir=cap, segment_max_bytes=2048)  # rotation due after each call
        base = proxy.openai_base("rinodes")
        with httpx.Client(timeout=30) as client:
            assert [call(client, base, f"call {i}", stream=i % 2 == 1)[0] for i in range(6)] == [200] * 6
        assert sorted(_contents(proxy.records())) == sorted(f"call {i}" for i in range(6))
        assert health(proxy)["status"] == "ok"
        proxy.server.stop(drain_timeout_s=5)
    finally:
        subprocess.run(["umount", "-l", str(cap)], check=False)
        up.stop()


def test_a_proxy_whose_capture_dir_holds_no_more_files_does_not_start_and_says_why(tmp_path: Path) -> None:
    from clawpipe.errors import CaptureError
    from clawpipe.proxy import ProxyServer
    from tests.proxy.conftest import SECRET

    cap = tmp_path / "cap"
    cap.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,nr_inodes=1", "tmpfs", str(cap)], check=True)
    try:
        proxy = ProxyServer(upstreams=["http://127.0.0.1:9"], capture_dir=cap, secret=SECRET, admin_token=ADMIN)
        with pytest.raises(CaptureError) as info:
            proxy.start()
        msg = str(info.value)
        assert f"cannot open a capture segment in {cap}" in msg and "no more files" in msg, msg
    finally:
        subprocess.run(["umount", "-l", str(cap)], check=False)


def test_a_batch_cut_short_by_a_full_disk_keeps_its_whole_frames_so_a_landing_in_between_stays_aligned(
    tmp_path: Path,
) -> None:
    """Three records written as one batch on a disk with room for two and a half: the two written whole are
    kept (a landing may read them at once) and only the third fails; a landing before and after the space is
    freed gets every record that was reported written, once, with no damaged region."""
    import json
    import threading

    from clawpipe.lake.landing import land as land_captures
    from clawpipe.proxy.segments import SegmentWriter
    from tests.lake import fixtures as fx

    with small_disk(tmp_path / "cap", 1024) as cap:
        writer = SegmentWriter(cap, instance="w", max_age_s=0)
        writer.start(lambda fn, arg: fn(arg))  # callbacks run on the writer thread
        outcomes: dict[str, BaseException | None] = {}
        fired = threading.Event()

        def submit(call_id: str, size: int) -> None:
            def done(exc: BaseException | None) -> None:
                outcomes[call_id] = exc
                if len(outcomes) == 4:
                    fired.set()

            hdr = capture.decode_header(json.dumps(fx.header(call_id=call_id, rollout_id="rb")).encode())
            request = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * size}]}).encode()
            writer.submit(hdr, request, fx.response_body("chat", False), done)

        frame = 40 << 10
        filler = fill(cap, frame * 5 // 2)
        with writer._cond:  # the three go to the writer thread as one batch
            for i in range(3):
                submit(f"b{i}", frame)
        deadline = time.monotonic() + 10
        while len(outcomes) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [outcomes[f"b{i}"] is None for i in range(3)] == [True, True, False]
        lake = tmp_path / "lake"
        first = land_captures(cap, lake)  # the open segment, while the disk is full
        filler.unlink()
        submit("after", 1000)
        assert fired.wait(10) and outcomes["after"] is None
        writer.close()
        second = land_captures(cap, lake)
        assert (first.calls, second.calls, first.rejects + second.rejects) == (2, 1, 0)
        ids = run_sql(lake, "select call_id from model_calls order by call_id").to_pylist()
        assert [r["call_id"] for r in ids] == ["after", "b0", "b1"]
