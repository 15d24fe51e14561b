"""Landing never holds a descriptor per source or per part: a real landing process under RLIMIT_NOFILE=64
lands thousands of segment files and result files, hundreds of partitions in one run, and into a partition
of hundreds of parts, every call exactly once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clawpipe.lake import land, run_sql
from tests.lake import fixtures as fx

ROOT = Path(__file__).resolve().parents[2]
FD_LIMIT = 64


def land_limited(cap: Path, lake: Path, *, in_memory: int | None = None) -> str:
    """Land in a child process that may hold FD_LIMIT descriptors; returns its report line."""
    code = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({FD_LIMIT}, {FD_LIMIT}))\n"
        "from clawpipe.lake import land, id_index\n"
        + (f"id_index.IN_MEMORY = {in_memory}\n" if in_memory is not None else "")
        + "r = land(sys.argv[1], sys.argv[2])\n"
        "print(r.calls, r.duplicates, r.rollouts, r.rejects)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(cap), str(lake)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def counts(lake: Path) -> dict[str, int]:
    return run_sql(lake, "select count(*) as n, count(distinct call_id) as d from model_calls").to_pylist()[0]


@pytest.mark.slow
def test_thousands_of_segments_and_result_files_land_under_a_low_descriptor_limit(tmp_path: Path) -> None:
    cap = tmp_path / "cap"
    for s in range(3000):
        fx.write_segment(cap / f"proxy-{s:06d}.seg", [fx.record(call_id=f"c{s}", rollout_id=f"r{s}", seq=0)])
    for b in range(300):
        rows = [fx.rollout_row(f"r{b * 10 + i}") for i in range(10)]
        fx.write_results(cap, rows, batch=f"b{b}")
    assert land_limited(cap, tmp_path / "lake") == "3000 0 3000 0"
    assert counts(tmp_path / "lake") == {"n": 3000, "d": 3000}
    assert run_sql(tmp_path / "lake", "select count(*) as n from rollouts").to_pylist() == [{"n": 3000}]


@pytest.mark.slow
def test_hundreds_of_partitions_in_one_landing_hold_a_bounded_number_of_open_parts(tmp_path: Path) -> None:
    cap = tmp_path / "cap"
    for s in range(300):  # 100 iterations of 3 runs, interleaved: every partition is met again later
        frames = [fx.record(call_id=f"c{s}-{i}", run_id=f"run{i % 3}", iteration=s % 100, seq=i) for i in range(3)]
        fx.write_segment(cap / f"proxy-{s:06d}.seg", frames)
    assert land_limited(cap, tmp_path / "lake") == "900 0 0 0"
    got = run_sql(tmp_path / "lake", "select count(distinct (run_id, iteration)) as p from model_calls").to_pylist()
    assert got == [{"p": 300}] and counts(tmp_path / "lake") == {"n": 900, "d": 900}


@pytest.mark.slow
@pytest.mark.parametrize("in_memory", [None, 0], ids=["sidecars-read", "sidecars-mapped"])
def test_a_partition_of_hundreds_of_parts_is_landed_into_under_a_low_descriptor_limit(
    tmp_path: Path, in_memory: int | None
) -> None:
    lake = tmp_path / "lake"
    first = tmp_path / "first"
    fx.write_segment(first / "proxy-a.seg", [fx.record(call_id=f"c{i}", seq=i) for i in range(300)])
    land(first, lake, batch_bytes=1, row_group_bytes=1)  # a commit per call: 300 parts in one partition
    assert len(list(lake.glob("model_calls/*/*/part-*.parquet"))) == 300
    more = tmp_path / "more"  # new calls, and copies of landed ones (each found through the sidecars)
    fx.write_segment(more / "proxy-b.seg", [fx.record(call_id=f"c{i}", seq=i) for i in range(290, 310)])
    assert land_limited(more, lake, in_memory=in_memory) == "10 10 0 0"
    assert counts(lake) == {"n": 310, "d": 310}
