"""A compaction SIGKILLed while it stages merged files: the partition stays whole, and its staged copy is not kept.

The lake's readers never see the staged folder (``_staging/locked-<id>``), so the data is safe; what is at stake
is space: a kill before the swap leaves the merged copy, a kill after it the whole old partition. The next
writer that takes the lake's lock (a landing or a compaction) removes them.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from clawpipe.lake import compact, land, run_sql
from tests.lake import fixtures as fx

ROOT = Path(__file__).resolve().parents[2]


def _kill_compaction_while_staging(tmp_path: Path) -> tuple[Path, Path, int]:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    n = 0
    for r in range(40):  # 40 parts of one partition: merging them takes long enough to be caught at it
        fx.write_segment(cap / f"p-{r:04d}.seg", [fx.record(call_id=f"r{r}-{i}", seq=i) for i in range(60)])
        n += 60
    _land_one_by_one(cap, lake)
    staging = lake / "_staging"
    cmd = [sys.executable, "-m", "clawpipe", "lake", "compact", "--lake", str(lake)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if staging.is_dir() and any(p.is_file() for p in staging.rglob("*")):
            break
        time.sleep(0.001)
    assert proc.poll() is None, "the compaction ended before it could be killed: give it more parts"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert any(p.is_file() for p in staging.rglob("*")), "the kill came before anything was staged"
    return cap, lake, n


def _land_one_by_one(cap: Path, lake: Path) -> None:
    """Land each segment in its own landing, so the partition holds one part per segment."""
    segs = sorted(cap.glob("*.seg"))
    hold = cap / "hold"
    hold.mkdir()
    for s in segs:
        s.rename(hold / s.name)
    for s in segs:
        (hold / s.name).rename(s)
        land(cap, lake)


def test_a_killed_compaction_leaves_the_partition_whole(tmp_path: Path) -> None:
    cap, lake, n = _kill_compaction_while_staging(tmp_path)
    got = run_sql(lake, "select count(*) as n, count(distinct call_id) as d from model_calls").to_pylist()[0]
    assert got == {"n": n, "d": n}
    assert land(cap, lake).calls == 0
    compact(lake)
    assert run_sql(lake, "select count(*) from model_calls").column(0)[0].as_py() == n


def test_a_killed_compactions_staged_files_are_removed_by_the_next_writer(tmp_path: Path) -> None:
    cap, lake, n = _kill_compaction_while_staging(tmp_path)
    land(cap, lake)  # the next lock holder: a landing with nothing new
    assert [str(p.relative_to(lake)) for p in (lake / "_staging").rglob("*") if p.is_file()] == []
    compact(lake)
    assert run_sql(lake, "select count(*) from model_calls").column(0)[0].as_py() == n
    assert [str(p.relative_to(lake)) for p in (lake / "_staging").rglob("*") if p.is_file()] == []
