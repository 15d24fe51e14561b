"""Landers and compactors SIGKILLed at random moments over one capture set: each call lands once, nothing stays.

Without a proxy in the way, a kill falls in every window of a landing: a part being written or published, a
sidecar, a rollouts merge, the manifest entry, a compaction's merge or its partition swap. A seeded RNG
picks the moments (``CLAWPIPE_CHAOS_SEED`` reruns one; failures name it).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clawpipe.lake import land, run_audits, run_sql
from tests.lake import fixtures as fx

ROOT = Path(__file__).resolve().parents[2]


def _start(cap: Path, lake: Path, what: str) -> subprocess.Popen[bytes]:
    if what == "compact":
        cmd = [sys.executable, "-m", "clawpipe", "lake", "compact", "--lake", str(lake)]
    else:
        code = "import sys; from clawpipe.lake import land; land(sys.argv[1], sys.argv[2], batch_bytes=8000, "
        code += "row_group_bytes=3000)"
        cmd = [sys.executable, "-c", code, str(cap), str(lake)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def leftovers(lake: Path) -> list[str]:
    """Temporary, staged and uncommitted files of the lake's writers."""
    left = list(lake.rglob("*.inprogress"))
    left += [p for p in (lake / "_staging").rglob("*") if p.is_file()]
    left += list((lake / "_manifest").glob("pending-*"))
    return sorted(str(p.relative_to(lake)) for p in left)


@pytest.mark.slow
def test_random_kills_of_landers_and_compactors(tmp_path: Path) -> None:
    seed = int(os.environ.get("CLAWPIPE_CHAOS_SEED") or 7)
    rng = random.Random(seed)
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    n = fx.rollout_segments(cap, 30, 30, iterations=3)
    lake.mkdir()  # compaction refuses a lake folder that does not exist
    kills = 0
    rounds = 0
    latest = 1.2  # kill moments are drawn up to this; lowered to what a finished round took, so that on a
    # fast machine the kills still fall inside the work rather than after it
    while kills < 30 and rounds < 120:
        rounds += 1
        roles = rng.choice([["land"], ["land"], ["land", "land"], ["compact"], ["land", "compact"]])
        t0 = time.monotonic()
        procs = [_start(cap, lake, r) for r in roles]
        time.sleep(rng.uniform(0.25, max(0.3, latest)))  # imports take ~0.3 s: most kills fall inside the work
        finished = all(p.poll() is not None for p in procs)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                kills += 1
        if finished:
            latest = min(latest, time.monotonic() - t0)
        for p in procs:
            _, err = p.communicate(timeout=60)
            assert p.returncode in (0, -signal.SIGKILL), f"seed {seed}: exited {p.returncode}: {err.decode()[-2000:]}"
        if rng.random() < 0.15:  # add captures between rounds, so landings keep finding new work
            fx.write_segment(
                cap / f"late-{rounds:04d}.seg",
                [fx.record(call_id=f"late{rounds}-{i}", rollout_id="r0", seq=100 + i) for i in range(20)],
            )
            n += 20
    assert kills >= 20, f"seed {seed}: only {kills} kills in {rounds} rounds"
    land(cap, lake)
    got = run_sql(lake, "select count(*) as n, count(distinct call_id) as d from model_calls").to_pylist()[0]
    assert got == {"n": n, "d": n}, f"seed {seed}"
    audits = run_audits(lake)
    assert {k: v.num_rows for k, v in audits.items()} == dict.fromkeys(audits, 0), f"seed {seed}"
    assert run_sql(lake, "select count(*) from rejects").column(0)[0].as_py() == 0, f"seed {seed}"
    assert land(cap, lake).calls == 0, f"seed {seed}"
    assert leftovers(lake) == [], f"seed {seed}: files left behind"


def test_a_landing_killed_while_writing_a_sidecar_leaves_no_temporary_file(tmp_path: Path) -> None:
    """A kill inside a sidecar's write (temp name, then rename) leaves ``<part>.ids.<x>.inprogress`` beside the
    published part; the next landing rolls the batch back and removes that file with its part."""
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    n = fx.rollout_segments(cap, 4, 10, iterations=3)
    code = "import sys; from clawpipe.lake import land; land(sys.argv[1], sys.argv[2])"
    env = {**os.environ, "CLAWPIPE_LAKE_CRASH_BEFORE_COMMIT": "1"}  # SIGKILL once the parts are published
    proc = subprocess.run([sys.executable, "-c", code, str(cap), str(lake)], cwd=ROOT, env=env, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    parts = sorted(lake.glob("model_calls/*/*/part-*.parquet"))
    assert parts
    for part in parts:  # what the same kill one step earlier, inside the sidecar's write, leaves
        part.with_suffix(".ids.0badc0de.inprogress").write_bytes(b"\x00" * 5)
    land(cap, lake)
    got = run_sql(lake, "select count(*) as n, count(distinct call_id) as d from model_calls").to_pylist()[0]
    assert got == {"n": n, "d": n}
    assert leftovers(lake) == []
