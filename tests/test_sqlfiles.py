"""The SQL loader's includes: a shared statement written once, run as a CTE of each file that includes it."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from clawpipe import sqlfiles
from clawpipe.errors import LakeError


def _rollouts(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(
        "create table rollouts as select * from (values "
        "('r1', 'g1', 0, 1, false, 'R'), ('r1', 'g1', 0, 2, false, 'R'), ('r2', 'g1', 0, null, false, 'R'),"
        "('r3', 'g2', 0, 1, true, 'R'), ('r4', 'g2', 1, 1, false, 'R'), ('r5', 'g3', 0, 1, false, 'S')"
        ") t(rollout_id, group_id, iteration, attempt, eval, run_id)"
    )


def test_included_latest_attempt_gives_one_row_per_rollout_of_the_iteration() -> None:
    con = duckdb.connect()
    _rollouts(con)
    got = con.sql(sqlfiles.sql_text("common/latest_rollouts"), params={"run_id": "R", "iteration": 0}).fetchall()
    assert sorted((r[0], r[3]) for r in got) == [("r1", 2), ("r2", None), ("r3", 1)]
    groups = con.sql(sqlfiles.sql_text("pipeline/landed_groups"), params={"run_id": "R", "iteration": 0}).fetchall()
    assert groups == [("g1", 2)]  # r1 once (two attempts), r2; r3 is an evaluation rollout


def test_include_becomes_a_cte_before_the_files_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "ones.sql").write_text("-- one row\nselect 1 as x;\n")
    (tmp_path / "q.sql").write_text(
        "-- doc\n-- include: common/ones\nwith twice as (select x * 2 as y from ones)\n\nselect y from twice\n"
    )
    (tmp_path / "plain.sql").write_text("-- include: common/ones\nselect x + 1 from ones\n")
    monkeypatch.setattr(sqlfiles, "SQL_DIR", tmp_path)
    text = sqlfiles._expand("q", ())
    assert text.startswith("-- doc\n-- include: common/ones\nwith ones as (")
    assert duckdb.sql(text).fetchall() == [(2,)]
    assert duckdb.sql(sqlfiles._expand("plain", ())).fetchall() == [(2,)]


def test_include_cycle_and_missing_include_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.sql").write_text("-- include: b\nselect 1\n")
    (tmp_path / "b.sql").write_text("-- include: a\nselect 2\n")
    (tmp_path / "c.sql").write_text("-- include: nowhere\nselect 3\n")
    monkeypatch.setattr(sqlfiles, "SQL_DIR", tmp_path)
    with pytest.raises(LakeError, match="include cycle: a -> b -> a"):
        sqlfiles._expand("a", ())
    with pytest.raises(LakeError, match=r"no SQL file .*nowhere\.sql"):
        sqlfiles._expand("c", ())


def test_latest_attempt_is_written_once_under_sql() -> None:
    pattern = "partition by rollout_id order by attempt desc"
    holders = sorted(
        str(p.relative_to(sqlfiles.SQL_DIR)) for p in sqlfiles.SQL_DIR.rglob("*.sql") if pattern in p.read_text()
    )
    assert holders == ["common/latest_rollouts.sql"]
