"""A lander stopped while it holds the lake, and a second one waiting: the second lands everything once, and
the first, resumed after the other took over, commits nothing more.

Local lakes serialise writers with ``flock``: a stopped holder keeps the lake until it dies, then the waiting
lander rolls back its uncommitted batch. On object storage the lease expires under a stopped holder and the
waiting lander takes it over and fences it out; the resumed holder must then stop without adding a row.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from clawpipe import schemas
from clawpipe.lake import land, manifest, run_sql
from clawpipe.lake.lease import Lease
from clawpipe.tables import LakeFS
from tests.lake import fixtures as fx

ROOT = Path(__file__).resolve().parents[2]


def _lander(cap: Path, lake: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    code = "import sys; from clawpipe.lake import land; land(sys.argv[1], sys.argv[2], batch_bytes=8000)"
    return subprocess.Popen(
        [sys.executable, "-c", code, str(cap), lake],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _wait_for_commits(lake: LakeFS, proc: subprocess.Popen[bytes], n: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            names = [f.rsplit("/", 1)[-1] for f in lake.list_files("_manifest")]
        except NotADirectoryError:  # on a bucket, a folder being made can list as a file for a moment
            names = []
        if sum(name.startswith("batch-") for name in names) >= n:
            return
        time.sleep(0.01)
    raise AssertionError(f"the first landing made no {n} commits before it ended ({proc.poll()})")


def _counts(lake: str) -> dict[str, int]:
    return run_sql(lake, "select count(*) as n, count(distinct call_id) as d from model_calls").to_pylist()[0]


def _pending(lake: LakeFS) -> list[str]:
    return [f for f in lake.list_files("_manifest") if f.rsplit("/", 1)[-1].startswith("pending-")]


@pytest.mark.slow
def test_local_lake_the_waiting_lander_lands_once_the_stopped_holder_dies(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    n = fx.rollout_segments(cap, 30, 40)
    a = _lander(cap, str(lake))
    _wait_for_commits(LakeFS(lake), a, 2)
    a.send_signal(signal.SIGSTOP)
    try:
        b = _lander(cap, str(lake))
        time.sleep(2.0)
        assert b.poll() is None, "the second lander did not wait for the holder of the lake"
    finally:
        a.send_signal(signal.SIGKILL)
        a.send_signal(signal.SIGCONT)
        a.communicate(timeout=30)
    _, err = b.communicate(timeout=180)
    assert b.returncode == 0, err.decode()[-2000:]
    assert _counts(str(lake)) == {"n": n, "d": n}
    assert _pending(LakeFS(lake)) == []
    assert land(cap, lake).calls == 0


@pytest.mark.slow
def test_bucket_lake_a_resumed_holder_commits_nothing_after_a_takeover(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    cap = tmp_path / "cap"
    lake_url = f"{request.getfixturevalue('s3_bucket')}/lake"
    lake = LakeFS(lake_url)
    n = fx.rollout_segments(cap, 12, 30)
    env = {"CLAWPIPE_LAKE_LEASE_TTL": "2"}
    a = _lander(cap, lake_url, env)
    _wait_for_commits(lake, a, 2)
    a.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        b = _lander(cap, lake_url, env)
        _, err_b = b.communicate(timeout=300)
        assert b.returncode == 0, err_b.decode()[-2000:]
        assert time.monotonic() - t0 >= 1.0  # it waited for the stopped holder's lease to expire
        assert _counts(lake_url) == {"n": n, "d": n}
        entries = [lake.read_bytes(f) for f in lake.list_files("_manifest") if "/batch-" in f]
        assert b'{"batch":"fence"}' in entries  # the taker fenced the stopped holder out
    finally:
        a.send_signal(signal.SIGCONT)
    _, err_a = a.communicate(timeout=120)
    assert a.returncode != 0, "the resumed holder went on landing after it lost the lake"
    assert "lost the writer lease" in err_a.decode() or "committed entry" in err_a.decode(), err_a.decode()[-2000:]
    assert _counts(lake_url) == {"n": n, "d": n}
    assert _pending(lake) == []
    assert not [f for f in lake.list_files("model_calls") if f.endswith(".inprogress")]
    assert land(cap, lake_url).calls == 0


@pytest.mark.slow
def test_bucket_lake_a_part_a_resumed_holder_publishes_after_the_takeover_is_rolled_back(
    s3_bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The holder was paused between its lease check and publishing a part; the taker rolled its batch back
    before the part existed. Resumed, it publishes the part and dies before its commit fails: the next
    landing must still roll that part back, or its calls are in the lake twice."""
    monkeypatch.setenv("CLAWPIPE_CAPTURE_CACHE", str(tmp_path / "cache"))
    cap = tmp_path / "cap"
    lake_url = f"{s3_bucket}/lake"
    lake = LakeFS(lake_url)
    n = fx.rollout_segments(cap, 1, 10)
    held = Lease(lake, ttl_s=1.0)
    held.acquire()
    held._stop.set()  # paused: no more renewals
    assert held._thread is not None
    held._thread.join()
    manifest.load(lake, held)
    part = "model_calls/run_id=run1/iteration=0/part-zombie.parquet"
    manifest.write_pending(lake, "zombie", [part])  # what the holder's batch recorded before it paused
    time.sleep(1.3)
    assert land(cap, lake_url).calls == n  # took the expired lease over, rolled the batch back, landed all
    # the holder resumes: its part goes up (as its publishing would), and it dies there
    rows = [
        {"call_id": f"s0-c{i}", "choice_index": 0, "run_id": "run1", "iteration": 0, "rollout_id": "r0"}
        for i in range(n)
    ]
    lake.write_parquet(part, pa.Table.from_pylist(rows, schema=schemas.MODEL_CALLS))
    assert land(cap, lake_url).calls == 0
    assert _counts(lake_url) == {"n": n, "d": n}
    assert _pending(lake) == []
    record = f"{manifest.DIR}/{manifest.ROLLED_BACK}zombie.json"
    assert lake.exists(record)  # kept while the paused writer may still come back
    monkeypatch.setattr(manifest, "ROLLED_BACK_KEEP_S", 0.0)
    assert land(cap, lake_url).calls == 0
    assert not lake.exists(record)  # forgotten once no writer can still be running that batch
