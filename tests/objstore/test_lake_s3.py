"""The lake and its captures on a real S3-compatible server (moto on loopback): every call exactly once.

Captures are uploaded by the proxy's uploader, landed from the bucket into a lake in the same bucket,
twice, from two processes at once, and again after a landing killed before its commit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest

from clawpipe import objstore
from clawpipe.errors import LakeError
from clawpipe.lake import land, manifest, run_sql
from clawpipe.lake.lease import Lease
from clawpipe.proxy.upload import Uploader
from clawpipe.tables import LakeFS
from tests.lake import fixtures as fx
from tests.objstore.captures import write_captures

pytestmark = pytest.mark.slow


def _upload(cap: Path, bucket: str, host: str = "h1") -> str:
    url = objstore.captures_url(f"{bucket}/lake")
    up = Uploader(cap, url, host=host)
    assert up.upload_once() == len(list(cap.glob("*.seg"))) + 1
    return url


def _counts(lake: str) -> tuple[int, int]:
    r = run_sql(lake, "select count(*) as n, count(distinct call_id) as d from model_calls").to_pylist()[0]
    return r["n"], r["d"]


def _land_cmd(captures: str, lake: str, batch_bytes: int) -> list[str]:
    code = (
        "import sys, json; from clawpipe.lake import land; "
        f"r = land({captures!r}, {lake!r}, batch_bytes={batch_bytes}); print(json.dumps(r.calls))"
    )
    return [sys.executable, "-c", code]


def test_conditional_create_has_one_winner(s3_bucket: str) -> None:
    lake = LakeFS(f"{s3_bucket}/lake")
    wins: list[int] = []

    def create(i: int) -> None:
        if lake.create_exclusive("_manifest/batch-1-x.json", str(i).encode()):
            wins.append(i)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert lake.read_bytes("_manifest/batch-1-x.json") == str(wins[0]).encode()


def test_land_twice_from_the_bucket(s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAWPIPE_CAPTURE_CACHE", str(tmp_path / "cache"))
    cap, n = write_captures(tmp_path, 3, 20)
    url = _upload(cap, s3_bucket)
    lake = f"{s3_bucket}/lake"
    first = land(url, lake, batch_bytes=4096)
    assert (first.calls, first.rollouts, first.rejects) == (n, 3, 0)
    assert first.batches > 1
    assert land(url, lake).calls == 0
    assert _counts(lake) == (n, n)
    assert run_sql(lake, "select count(*) from rollouts").column(0)[0].as_py() == 3


def test_the_reconstruct_cache_key_sees_a_bucket_lake(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pipeline caches tree building by the landed files' names and sizes: on a bucket lake they are
    listed from the bucket (a key that stayed empty would keep stale trees after more calls land)."""
    from clawpipe.config import Settings
    from clawpipe.pipeline.stages import landed_fingerprint

    monkeypatch.setenv("CLAWPIPE_CAPTURE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CLAWPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CLAWPIPE_LAKE_URI", f"{s3_bucket}/lake")
    settings = Settings()
    assert landed_fingerprint(settings, "run1", 0) == ""
    cap, _ = write_captures(tmp_path, 2, 5)
    land(_upload(cap, s3_bucket), settings.lake_dir)
    first = landed_fingerprint(settings, "run1", 0)
    assert first.count(".parquet:") >= 2  # model_calls and rollouts, each with its size
    more = tmp_path / "more"
    fx.write_segment(more / "p9-000009.seg", [fx.record(call_id="late", rollout_id="r0", seq=9)])
    up = Uploader(more, objstore.captures_url(f"{s3_bucket}/lake"), host="h2")
    assert up.upload_once() == 1
    land(objstore.captures_url(f"{s3_bucket}/lake"), settings.lake_dir)
    assert landed_fingerprint(settings, "run1", 0) not in ("", first)


def test_clawpipe_land_takes_a_bucket_url(s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from clawpipe.cli import app

    monkeypatch.setenv("CLAWPIPE_CAPTURE_CACHE", str(tmp_path / "cache"))
    cap, n = write_captures(tmp_path, 2, 5)
    url = _upload(cap, s3_bucket)
    lake = f"{s3_bucket}/lake"
    out = CliRunner().invoke(app, ["land", "--captures", url, "--lake", lake])
    assert out.exit_code == 0, out.output
    assert _counts(lake) == (n, n)


def test_two_processes_land_at_once(s3_bucket: str, tmp_path: Path) -> None:
    cap, n = write_captures(tmp_path, 4, 40)
    url = _upload(cap, s3_bucket)
    lake = f"{s3_bucket}/lake"
    env = {**os.environ}
    procs = []
    for i in range(2):
        env_i = {**env, "CLAWPIPE_CAPTURE_CACHE": str(tmp_path / f"cache{i}")}
        procs.append(subprocess.Popen(_land_cmd(url, lake, 4096), env=env_i, stdout=subprocess.PIPE, text=True))
    landed = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0
        landed.append(int(out.strip().splitlines()[-1]))
    assert sum(landed) == n  # the lease serialised them: the second found everything landed
    assert _counts(lake) == (n, n)


def test_killed_landing_then_land_again(s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAWPIPE_CAPTURE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CLAWPIPE_LAKE_LEASE_TTL", "2")
    cap, n = write_captures(tmp_path, 3, 30)
    url = _upload(cap, s3_bucket)
    lake = f"{s3_bucket}/lake"
    env = {**os.environ, "CLAWPIPE_LAKE_CRASH_BEFORE_COMMIT": "2"}
    p = subprocess.run(_land_cmd(url, lake, 4096), env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == -9
    lk = LakeFS(lake)
    assert lk.exists("_manifest/lease.json")  # the killed writer still "holds" the lake
    assert any(f.rsplit("/", 1)[-1].startswith("pending-") for f in lk.list_files("_manifest"))
    before, _ = _counts(lake)
    assert before > 0  # the killed batch's parts are visible until rolled back
    t0 = time.monotonic()
    again = land(url, lake, batch_bytes=4096)
    assert time.monotonic() - t0 >= 1.0  # waited for the dead writer's lease to expire, then took it over
    assert _counts(lake) == (n, n)
    assert not any("pending-" in f for f in lk.list_files("_manifest"))
    entries = [lk.read_bytes(f) for f in lk.list_files("_manifest") if "/batch-" in f]
    assert b'{"batch":"fence"}' in entries  # the taker fenced the dead writer out before rolling it back
    assert again.calls < n and land(url, lake).calls == 0


def test_a_writer_whose_lease_was_taken_cannot_commit(s3_bucket: str) -> None:
    lake = LakeFS(f"{s3_bucket}/lake")
    a = Lease(lake, ttl_s=1.0)
    a.acquire()
    a._stop.set()  # a paused holder: its renewals stop
    assert a._thread is not None
    a._thread.join()
    state_a = manifest.load(lake, a)
    time.sleep(1.3)
    b = Lease(lake, ttl_s=30.0)
    b.acquire(timeout_s=10)
    assert b.took_over
    state_b = manifest.load(lake, b)  # commits a fence past every entry
    assert state_b.seq > state_a.seq
    with pytest.raises(LakeError, match="lost the writer lease"):
        manifest.commit(lake, "a1", {"segments": {}, "results": {}, "parts": []}, state_a)
    state_a.lease = None  # even without its own lease check, the store refuses the late commit
    with pytest.raises(LakeError, match="committed entry"):
        manifest.commit(lake, "a1", {"segments": {}, "results": {}, "parts": []}, state_a)
    manifest.commit(lake, "b1", {"segments": {"k": [0, 5, True]}, "results": {}, "parts": []}, state_b)
    assert manifest.load(lake).segments["k"].end == 5
    b.release()
    assert not lake.exists("_manifest/lease.json")


def test_compaction_on_the_bucket_and_a_killed_one(s3_bucket: str, tmp_path: Path) -> None:
    from clawpipe.lake import compact
    from clawpipe.lake.compaction import finish_interrupted
    from clawpipe.tables import COMPACT_PREFIX, TMP_SUFFIX, table_files

    lake = f"{s3_bucket}/lake"
    cap = tmp_path / "cap"
    for r in range(3):
        fx.write_segment(cap / f"p-{r:06d}.seg", [fx.record(call_id=f"k{r}-{i}", seq=i) for i in range(10)])
        land(cap, lake)
    lk = LakeFS(lake)
    part = "model_calls/run_id=run1/iteration=0"
    old = lk.list_files(part, suffix=".parquet")
    assert len(old) == 3
    # a compaction killed after its record and one published file: readers keep the old files
    merged = lk.read_parquet(old[0])
    lk.write_parquet(f"{part}/part-cdead.parquet", merged)
    lk.write_bytes(
        f"{COMPACT_PREFIX}dead.json",
        orjson.dumps({"old": old, "new": [f"{part}/part-cdead.parquet", f"{part}/part-cgone.parquet"]}),
    )
    assert _counts(lake) == (30, 30)  # pinned file lists apply the record: no row twice
    assert len(table_files(lk)["model_calls"]) == 3
    assert finish_interrupted(lk) == 1  # undone: the published half is deleted
    assert lk.list_files(part, suffix=".parquet") == old
    rep = compact(lake)
    assert (rep.files_before, rep.files_after, rep.rows) == (3, 1, 30)
    assert _counts(lake) == (30, 30)
    assert len(lk.list_files(part, suffix=".parquet")) == 1
    assert not lk.list_files(part, suffix=TMP_SUFFIX)
    assert land(cap, lake).calls == 0
