"""Lake access: empty views have the schema's columns; partitions are replaced, never duplicated."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from clawpipe import schemas, tables


def _rollouts(run: str, it: int, n: int) -> pa.Table:
    rows = [{"rollout_id": f"{run}-{it}-{i}", "run_id": run, "iteration": it, "reward": float(i)} for i in range(n)]
    return pa.Table.from_pylist(rows, schema=schemas.ROLLOUTS)


def test_empty_lake_has_typed_views(tmp_path: Path) -> None:
    con = tables.connect(tmp_path / "lake")
    for name, schema in schemas.TABLES.items():
        rel = con.sql(f"select * from {name}")
        assert rel.columns == schema.names
        assert rel.fetchall() == []


def test_replace_partition_is_idempotent(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    tables.replace_partition(lake, "rollouts", "r1", 0, _rollouts("r1", 0, 3))
    tables.replace_partition(lake, "rollouts", "r1", 0, _rollouts("r1", 0, 2))
    tables.replace_partition(lake, "rollouts", "r1", 1, _rollouts("r1", 1, 4))
    con = tables.connect(lake)
    got = con.sql("select iteration, count(*) from rollouts group by 1 order by 1").fetchall()
    assert got == [(0, 2), (1, 4)]
    assert not list((lake / "_staging").iterdir())
