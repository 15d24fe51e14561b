"""A landing of rollout results costs the rows it brings, not the rows its partition already holds: landing the
results of an iteration in many small landings (async mode lands every few seconds) reads only the key columns
of the rows landed before and writes only the new rows, while per rollout_id the latest attempt still wins for
every reader, also after compaction merges the parts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from clawpipe.lake import compact, land, run_audits, run_sql
from clawpipe.lake.compaction import LEAST_FILES
from clawpipe.lake.rollouts import KEY_COLUMNS
from clawpipe.tables import LakeFS
from tests.lake import fixtures as fx

PER_LANDING = 3


class _Touched:
    """Rows and values LakeFS reads and writes under a rollouts partition while it is wrapped."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.key_values = 0  # values read of the rollout_id / attempt columns
        self.other_values = 0  # values read of every other column (whole rows)
        self.rows_written = 0
        read, write = LakeFS.read_parquet, LakeFS.write_parquet

        def read_parquet(lake: LakeFS, rel: str, columns: list[str] | None = None) -> pa.Table:
            table = read(lake, rel, columns)
            if rel.startswith("rollouts/"):
                for name in table.column_names:
                    if name in KEY_COLUMNS:
                        self.key_values += table.num_rows
                    else:
                        self.other_values += table.num_rows
            return table

        def write_parquet(lake: LakeFS, rel: str, table: pa.Table) -> None:
            if "rollouts" in rel or rel.startswith("_staging/"):
                self.rows_written += table.num_rows
            write(lake, rel, table)

        monkeypatch.setattr(LakeFS, "read_parquet", read_parquet)
        monkeypatch.setattr(LakeFS, "write_parquet", write_parquet)


def _landings(cap: Path, lake: Path, first: int, count: int) -> None:
    for k in range(first, first + count):
        rows = [fx.rollout_row(f"r{k}-{i}", group_id=f"g{k}") for i in range(PER_LANDING)]
        fx.write_results(cap, rows, batch=f"b{k}")
        assert land(cap, lake).rollouts == PER_LANDING


def _one_more_landing(tmp_path: Path, earlier: int, monkeypatch: pytest.MonkeyPatch) -> _Touched:
    cap, lake = tmp_path / f"cap{earlier}", tmp_path / f"lake{earlier}"
    _landings(cap, lake, 0, earlier)
    with monkeypatch.context() as m:
        touched = _Touched(m)
        _landings(cap, lake, earlier, 1)
    assert run_sql(lake, "select count(*) from rollouts").column(0)[0].as_py() == (earlier + 1) * PER_LANDING
    return touched


def test_a_landing_of_new_results_reads_no_earlier_row_and_writes_only_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = _one_more_landing(tmp_path, 2, monkeypatch)
    large = _one_more_landing(tmp_path, 20, monkeypatch)
    # whole rows of the partition: none read, at either size (a rewrite read every one: 6, then 60 rows)
    assert (small.other_values, large.other_values) == (0, 0)
    # what is written is the landing's own rows, at either size (a rewrite wrote 9, then 63)
    assert (small.rows_written, large.rows_written) == (PER_LANDING, PER_LANDING)
    # of the rows landed before, the two key columns alone are read
    assert small.key_values == 2 * 2 * PER_LANDING and large.key_values == 2 * 20 * PER_LANDING


def _rollouts(lake: Path) -> list[dict[str, Any]]:
    query = "select rollout_id, status, reward, attempt from rollouts order by rollout_id"
    return run_sql(lake, query).to_pylist()


def test_latest_attempt_wins_across_appended_parts_and_compaction(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    _landings(cap, lake, 0, 4)  # r0-*, r1-*, r2-*, r3-*: four parts
    part_dir = lake / "rollouts" / "run_id=run1" / "iteration=0"
    assert len(list(part_dir.glob("*.parquet"))) == 4
    # a retry of r1-0 (attempt 1) supersedes the row a part holds (the partition is rewritten); a stale attempt 0
    # of it landed after that is dropped; an equal attempt of r2-0 landed later replaces the held one
    retry = fx.rollout_row("r1-0", group_id="g1", status="succeeded", reward=0.75, attempt=1)
    fx.write_results(cap, [fx.rollout_row("r1-0", group_id="g1", status="infra_error", reward=None)], batch="x0")
    fx.write_results(cap, [retry], batch="x1")
    land(cap, lake)
    fx.write_results(cap, [fx.rollout_row("r1-0", group_id="g1", status="infra_error", attempt=0)], batch="x2")
    fx.write_results(cap, [fx.rollout_row("r2-0", group_id="g2", status="failed", reward=0.0, attempt=0)], batch="x2")
    land(cap, lake)
    expected = [
        {"rollout_id": f"r{k}-{i}", "status": "succeeded", "reward": 0.75 if (k, i) == (1, 0) else 1.0,
         "attempt": 1 if (k, i) == (1, 0) else 0}
        for k in range(4) for i in range(PER_LANDING)
    ]  # fmt: skip
    expected[2 * PER_LANDING] = {"rollout_id": "r2-0", "status": "failed", "reward": 0.0, "attempt": 0}
    assert _rollouts(lake) == expected
    _landings(cap, lake, 4, LEAST_FILES["rollouts"] - 2)  # parts beside the rewritten one: one too few to merge
    assert compact(lake).partitions == 0
    _landings(cap, lake, LEAST_FILES["rollouts"] + 2, 1)
    assert len(list(part_dir.glob("*.parquet"))) == LEAST_FILES["rollouts"]
    rep = compact(lake)
    assert (rep.partitions, rep.files_after, rep.duplicates_dropped) == (1, 1, 0)
    assert len(list(part_dir.glob("*.parquet"))) == 1
    after = _rollouts(lake)
    first_four = {e["rollout_id"] for e in expected}
    assert [r for r in after if r["rollout_id"] in first_four] == expected and len(after) == (
        LEAST_FILES["rollouts"] + 3
    ) * PER_LANDING
    assert all(t.num_rows == 0 for t in run_audits(lake).values())


def test_an_append_killed_mid_write_leaves_nothing_once_the_next_landing_ran(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    _landings(cap, lake, 0, 1)
    part_dir = lake / "rollouts" / "run_id=run1" / "iteration=0"
    (part_dir / "part-killed.parquet.inprogress").write_bytes(b"PAR1 half a part")  # what a SIGKILL leaves
    _landings(cap, lake, 1, 1)
    assert sorted(p.suffix for p in part_dir.iterdir()) == [".parquet", ".parquet"]
    assert len(_rollouts(lake)) == 2 * PER_LANDING
