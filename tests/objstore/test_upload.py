"""Captures on object storage: the proxy's uploader against a real S3-compatible server (moto on loopback),
and two worker hosts (separate homes, each with its own proxy) uploading to one bucket, landed once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from clawpipe import objstore
from clawpipe.lake import land, run_sql
from clawpipe.proxy.segments import SegmentWriter
from clawpipe.proxy.upload import Uploader
from tests.lake import fixtures as fx

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _write(writer: SegmentWriter, n: int) -> None:
    done: list[BaseException | None] = []
    for i in range(n):
        h = fx.header(call_id=f"w{i}", rollout_id="r0", seq=i)
        durable = threading.Event()

        def fired(exc: BaseException | None, durable: threading.Event = durable) -> None:
            done.append(exc)
            durable.set()

        writer.submit(h, fx.request_body("chat", False), fx.response_body("chat", False), fired)
        assert durable.wait(10)  # one record per write: the writer rotates by size between them
    writer.close()
    assert done == [None] * n


def test_the_capture_writer_uploads_each_sealed_segment(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLAWPIPE_LAKE_URI", f"{s3_bucket}/lake")
    monkeypatch.setenv("CLAWPIPE_CAPTURE_CACHE", str(tmp_path / "cache"))
    cap = tmp_path / "cap"
    writer = SegmentWriter(cap, instance="p", max_bytes=4096)  # rotates every few records
    writer.start(lambda fn, arg: fn(arg))
    assert writer.uploader is not None  # the object-store lake in the environment turned it on
    _write(writer, 40)
    fs, root = objstore.filesystem(objstore.captures_url(f"{s3_bucket}/lake"))
    host = objstore.host_id(cap)
    local = sorted(cap.glob("*.seg"))
    assert len(local) > 2
    for seg in local:
        assert fs.cat_file(f"{root}/{host}/{seg.name}") == seg.read_bytes()
    rep = land(objstore.captures_url(f"{s3_bucket}/lake"), f"{s3_bucket}/lake")
    assert (rep.calls, rep.rejects) == (40, 0)


def test_a_local_segment_is_deleted_only_after_its_upload_is_confirmed(s3_bucket: str, tmp_path: Path) -> None:
    cap = tmp_path / "cap"
    seg = fx.write_segment(cap / "p-000000.seg", [fx.record(call_id=f"d{i}") for i in range(5)])
    data = seg.read_bytes()
    results = fx.write_results(cap, [fx.rollout_row("r0")])
    missing = Uploader(cap, "s3://no-such-bucket-here/captures", host="h", delete_uploaded=True)
    assert missing.upload_once() == 0
    assert missing.errors == 2 and seg.exists()  # nothing confirmed: nothing deleted
    url = objstore.captures_url(f"{s3_bucket}/lake")
    up = Uploader(cap, url, host="h", delete_uploaded=True)
    assert up.upload_once() == 2
    assert not seg.exists() and results.exists()  # result files stay: the runner appends to them
    fs, root = objstore.filesystem(url)
    assert fs.cat_file(f"{root}/h/p-000000.seg") == data
    assert up.upload_once() == 0
    # a restarted uploader finds the stored sizes equal: nothing is sent again
    assert Uploader(cap, url, host="h").upload_once() == 0
    with results.open("a") as f:
        f.write('{"rollout_id": "r1"}\n')
    assert up.upload_once() == 1  # a grown result file goes up whole again
    assert fs.cat_file(f"{root}/results/h/{results.relative_to(cap / 'results')}") == results.read_bytes()


def test_two_hosts_upload_to_one_bucket_and_land_once(s3_bucket: str, tmp_path: Path) -> None:
    lake = f"{s3_bucket}/lake"
    calls = 12
    procs = []
    for name in ("hostA", "hostB"):
        home = tmp_path / name
        home.mkdir()
        env = {**os.environ, "CLAWPIPE_HOME": str(home), "CLAWPIPE_LAKE_URI": lake, "PYTHONPATH": str(REPO)}
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.objstore.host", str(home), str(calls)], env=env))
    for p in procs:
        assert p.wait(timeout=300) == 0
    url = objstore.captures_url(lake)
    fs, root = objstore.filesystem(url)
    hosts = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root) if not p.endswith("/results"))
    assert len(hosts) == 2  # two homes on one machine are two hosts
    env_cache = {"CLAWPIPE_CAPTURE_CACHE": str(tmp_path / "cache")}
    os.environ.update(env_cache)
    try:
        rep = land(url, lake)
        again = land(url, lake)
    finally:
        os.environ.pop("CLAWPIPE_CAPTURE_CACHE")
    assert (rep.calls, rep.rollouts, rep.rejects, again.calls) == (2 * calls, 4, 0, 0)
    r = run_sql(lake, "select count(*) n, count(distinct call_id) d, count(distinct rollout_id) ro from model_calls")
    assert r.to_pylist()[0] == {"n": 2 * calls, "d": 2 * calls, "ro": 4}


def test_a_flush_request_seals_the_open_segment_and_uploads_it(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clawpipe.proxy.upload import request_flush

    monkeypatch.setenv("CLAWPIPE_LAKE_URI", f"{s3_bucket}/lake")
    cap = tmp_path / "cap"
    assert request_flush(cap) is None  # no uploader alive here: nobody to ask
    writer = SegmentWriter(cap, instance="p", max_age_s=3600)  # would not seal by itself for an hour
    writer.start(lambda fn, arg: fn(arg))
    try:
        for i in range(3):
            durable = threading.Event()
            h = fx.header(call_id=f"f{i}", rollout_id="r0", seq=i)
            writer.submit(
                h, fx.request_body("chat", False), fx.response_body("chat", False), lambda e, d=durable: d.set()
            )
            assert durable.wait(10)
        results = fx.write_results(cap, [fx.rollout_row("r0")])
        url = objstore.captures_url(f"{s3_bucket}/lake")
        fs, root = objstore.filesystem(url)
        host = objstore.host_id(cap)
        assert not fs.exists(f"{root}/{host}") and not list(cap.glob("*.seg"))  # still open, nothing sent
        report = request_flush(cap, timeout_s=30)
        assert report is not None and report["ok"] and report["pending"] == []
        (seg,) = cap.glob("*.seg")
        assert fs.cat_file(f"{root}/{host}/{seg.name}") == seg.read_bytes()
        assert fs.cat_file(f"{root}/results/{host}/{results.relative_to(cap / 'results')}") == results.read_bytes()
        assert not list((cap / "flush").glob("*.request")) and not list((cap / "flush").glob("*.done"))
    finally:
        writer.close()
    assert request_flush(cap) is None  # the closed writer's uploader took its marker away
    rep = land(objstore.captures_url(f"{s3_bucket}/lake"), f"{s3_bucket}/lake")
    assert (rep.calls, rep.rejects) == (3, 0)
