"""A landing of rollout results costs about the rows it brings, not the rows its partition already holds:
landing an iteration's results in many small landings (async mode lands every few seconds) reads only the key
columns of the parts it leaves alone and rewrites rows a few times over the partition's life (parts merge
geometrically), while per rollout_id the latest attempt still wins for every reader."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clawpipe.lake import land, run_audits, run_sql
from clawpipe.lake.rollouts import KEY_COLUMNS
from clawpipe.tables import LakeFS
from tests.lake import fixtures as fx

PER_LANDING = 3


class _Touched:
    """Rows LakeFS reads and writes under rollouts partitions while it is wrapped, and parts read per landing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.whole_rows_read = 0  # rows read with columns beyond rollout_id / attempt
        self.rows_written = 0
        self.parts_read: list[set[str]] = [set()]  # per landing
        read, write = LakeFS.read_parquet, LakeFS.write_parquet

        def read_parquet(lake: LakeFS, rel: str, columns: list[str] | None = None) -> pa.Table:
            table = read(lake, rel, columns)
            if rel.startswith("rollouts/"):
                self.parts_read[-1].add(rel)
                if columns is None or set(columns) - set(KEY_COLUMNS):
                    self.whole_rows_read += table.num_rows
            return table

        def write_parquet(lake: LakeFS, rel: str, table: pa.Table) -> None:
            if rel.startswith(("rollouts/", "_staging/")):
                self.rows_written += table.num_rows
            write(lake, rel, table)

        monkeypatch.setattr(LakeFS, "read_parquet", read_parquet)
        monkeypatch.setattr(LakeFS, "write_parquet", write_parquet)


def _landings(cap: Path, lake: Path | str, first: int, count: int, touched: _Touched | None = None) -> None:
    for k in range(first, first + count):
        rows = [fx.rollout_row(f"r{k}-{i}", group_id=f"g{k}") for i in range(PER_LANDING)]
        fx.write_results(cap, rows, batch=f"b{k}")
        assert land(cap, lake).rollouts == PER_LANDING
        if touched is not None:
            touched.parts_read.append(set())


def _many_landings(tmp_path: Path, n: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    cap, lake = tmp_path / f"cap{n}", tmp_path / f"lake{n}"
    with monkeypatch.context() as m:
        touched = _Touched(m)
        _landings(cap, lake, 0, n, touched)
    assert run_sql(lake, "select count(*) from rollouts").column(0)[0].as_py() == n * PER_LANDING
    parts = len(list((lake / "rollouts" / "run_id=run1" / "iteration=0").glob("*.parquet")))
    landed = n * PER_LANDING
    return {
        "written_per_row": touched.rows_written / landed,
        "read_per_row": touched.whole_rows_read / landed,
        "most_parts_read": max(len(p) for p in touched.parts_read),
        "parts": parts,
    }


def test_many_small_landings_rewrite_each_row_a_few_times_not_once_per_landing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    few = _many_landings(tmp_path, 4, monkeypatch)
    many = _many_landings(tmp_path, 32, monkeypatch)
    for n, got in ((4, few), (32, many)):
        bound = math.log2(n) + 1
        # a row is written when it lands and again at most once per doubling of the partition (a rewrite of the
        # partition at every landing wrote (n + 1) / 2 = 2.5, then 16.5 rows per row landed)
        assert got["written_per_row"] <= bound, (n, got)
        assert got["read_per_row"] <= bound - 1, (n, got)
        # the partition keeps a few parts, and a landing opens no more than those
        assert got["parts"] <= bound and got["most_parts_read"] <= bound, (n, got)


def _rollouts(lake: Path) -> list[dict[str, Any]]:
    query = "select rollout_id, status, reward, attempt from rollouts order by rollout_id"
    return run_sql(lake, query).to_pylist()


def test_latest_attempt_wins_across_merged_and_appended_parts(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    _landings(cap, lake, 0, 3)  # r0-*, r1-*, r2-*: parts of 6 and 3 rows
    part_dir = lake / "rollouts" / "run_id=run1" / "iteration=0"
    assert sorted(pq.read_metadata(p).num_rows for p in part_dir.glob("*.parquet")) == [3, 6]
    # a retry of r0-0 (attempt 1) supersedes the row the larger part holds (that part is merged); a stale
    # attempt 0 of it landed after that is dropped; an equal attempt of r2-0 landed later replaces the held one
    fx.write_results(cap, [fx.rollout_row("r0-0", group_id="g0", status="infra_error", reward=None)], batch="x0")
    fx.write_results(cap, [fx.rollout_row("r0-0", group_id="g0", reward=0.75, attempt=1)], batch="x1")
    land(cap, lake)
    fx.write_results(cap, [fx.rollout_row("r0-0", group_id="g0", status="infra_error", attempt=0)], batch="x2")
    fx.write_results(cap, [fx.rollout_row("r2-0", group_id="g2", status="failed", reward=0.0, attempt=0)], batch="x2")
    land(cap, lake)
    expected = {
        f"r{k}-{i}": {"rollout_id": f"r{k}-{i}", "status": "succeeded", "reward": 1.0, "attempt": 0}
        for k in range(3)
        for i in range(PER_LANDING)
    }
    expected["r0-0"] = {"rollout_id": "r0-0", "status": "succeeded", "reward": 0.75, "attempt": 1}
    expected["r2-0"] = {"rollout_id": "r2-0", "status": "failed", "reward": 0.0, "attempt": 0}
    assert _rollouts(lake) == sorted(expected.values(), key=lambda r: r["rollout_id"])
    _landings(cap, lake, 3, 9)  # merged and appended parts beside them
    after = {r["rollout_id"]: r for r in _rollouts(lake)}
    assert len(after) == 12 * PER_LANDING and {k: after[k] for k in expected} == expected
    assert all(t.num_rows == 0 for t in run_audits(lake).values())  # duplicate_rollout_ids among them
    assert len(list(part_dir.glob("*.parquet"))) <= math.log2(12) + 1


def test_an_append_killed_mid_write_leaves_nothing_once_the_next_landing_ran(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    _landings(cap, lake, 0, 1)
    part_dir = lake / "rollouts" / "run_id=run1" / "iteration=0"
    (part_dir / "part-killed.parquet.inprogress").write_bytes(b"PAR1 half a part")  # what a SIGKILL leaves
    _landings(cap, lake, 1, 1)
    assert [p.suffix for p in part_dir.iterdir()] == [".parquet"]  # 3 rows merged with 3: one part
    assert len(_rollouts(lake)) == 2 * PER_LANDING


def test_landings_into_a_lake_on_a_filesystem_url_merge_parts_and_keep_each_rollout_once(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", f"memory://rollouts-{tmp_path.name}"
    _landings(cap, lake, 0, 5)
    fx.write_results(cap, [fx.rollout_row("r1-1", group_id="g1", reward=0.5, attempt=2)], batch="retry")
    land(cap, lake)
    rows = run_sql(lake, "select rollout_id, reward, attempt from rollouts order by rollout_id").to_pylist()
    assert len(rows) == 5 * PER_LANDING and len({r["rollout_id"] for r in rows}) == len(rows)
    assert [r for r in rows if r["attempt"]] == [{"rollout_id": "r1-1", "reward": 0.5, "attempt": 2}]
    parts = LakeFS(lake).list_files("rollouts", suffix=".parquet")
    assert 1 <= len(parts) <= math.log2(6) + 1 and not LakeFS(lake).list_files("_staging")
