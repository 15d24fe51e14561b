"""A landing killed half-way (SIGKILL of a real process) and run again ends with every call exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clawpipe.lake import land, run_audits, run_sql
from tests.lake import fixtures as fx

ROOT = Path(__file__).resolve().parents[2]


def _lander(cap: Path, lake: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    code = (
        "import sys; from clawpipe.lake import land; "
        "land(sys.argv[1], sys.argv[2], batch_bytes=6000, row_group_bytes=3000)"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, str(cap), str(lake)],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _assert_exactly_once(lake: Path, n_calls: int) -> None:
    got = run_sql(lake, "select count(*) as n, count(distinct call_id) as d from model_calls").to_pylist()[0]
    assert got == {"n": n_calls, "d": n_calls}
    audits = run_audits(lake)
    assert {k: v.num_rows for k, v in audits.items()} == dict.fromkeys(audits, 0)


def test_killed_between_publishing_parts_and_commit(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    n = fx.rollout_segments(cap, 6, 8, iterations=2)
    proc = _lander(cap, lake, {"CLAWPIPE_LAKE_CRASH_BEFORE_COMMIT": "3"})
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err.decode()
    # the dead batch's parts are visible and uncommitted: the views hold fewer calls than exist, none twice
    partial = run_sql(lake, "select count(*), count(distinct call_id) from model_calls").to_pylist()[0]
    assert 0 < partial["count_star()"] == partial["count(DISTINCT call_id)"] < n
    assert list((lake / "_manifest").glob("pending-*.json"))
    rep = land(cap, lake)
    assert rep.calls + partial["count_star()"] >= n  # the uncommitted batch was rolled back and landed again
    _assert_exactly_once(lake, n)
    assert not list((lake / "_manifest").glob("pending-*.json"))
    assert land(cap, lake).calls == 0


@pytest.mark.slow
def test_sigkill_at_an_arbitrary_moment(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    n = fx.rollout_segments(cap, 40, 40, iterations=2)
    proc = _lander(cap, lake)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if len(list((lake / "_manifest").glob("batch-*.json"))) >= 5:
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the landing finished before it could be killed: give it more work"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    before = run_sql(lake, "select count(*) from model_calls").column(0)[0].as_py()
    assert 0 < before < n
    land(cap, lake)
    _assert_exactly_once(lake, n)
    assert run_sql(lake, "select count(*) from rollouts").column(0)[0].as_py() == 40
