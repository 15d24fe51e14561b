"""The SQL stage (sql/trees/*.sql) on real Parquet partitions through tables.connect."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from clawpipe import schemas, tables
from clawpipe.sqlfiles import sql_text
from clawpipe.trees.reconstruct import plan_batches
from tests.trees.fixtures import call, write_lake


def test_calls_sql_joins_latest_attempt_orders_and_filters_groups(tmp_path: Path) -> None:
    calls = [
        call("c2", "ra", 1, [1, 2], [3]),
        call("c1", "ra", 0, [1], [2]),
        call("d1", "rb", 0, [9], None, status="http_error"),
        call("e1", "rc", 0, [7], [8]),
    ]
    write_lake(tmp_path, "R", 0, calls, [])
    rolls = [
        {"rollout_id": "ra", "group_id": "g-old", "reward": 0.0, "attempt": 0},
        {"rollout_id": "ra", "group_id": "g1", "reward": 1.0, "attempt": 1, "sample_idx": 0},
        {"rollout_id": "rb", "group_id": "g1", "reward": 0.5, "attempt": 0, "sample_idx": 1},
        {"rollout_id": "rc", "group_id": None, "reward": None, "attempt": 0},
    ]
    rows = [{**r, "run_id": "R", "iteration": 0} for r in rolls]
    tables.replace_partition(tmp_path, "rollouts", "R", 0, pa.Table.from_pylist(rows, schemas.ROLLOUTS))
    con = tables.connect(tmp_path)
    params = {"run_id": "R", "iteration": 0, "all_groups": True, "group_ids": ["x"]}
    got = con.sql(sql_text("trees/calls"), params=params).to_arrow_table().to_pylist()
    assert [(r["call_id"], r["group_id"], r["reward"]) for r in got] == [
        ("c1", "g1", 1.0),
        ("c2", "g1", 1.0),
        ("d1", "g1", 0.5),
        ("e1", "rc", None),  # no group: a group of its own
    ]
    only = con.sql(sql_text("trees/calls"), params={**params, "all_groups": False, "group_ids": ["rc"]})
    assert [r[0] for r in only.fetchall()] == ["e1"]
    groups = con.sql(sql_text("trees/groups"), params={"run_id": "R", "iteration": 0}).to_arrow_table()
    assert groups.to_pylist() == [
        {"group_id": "g1", "n_rollouts": 2, "n_rows": 3, "n_tokens": 1 + 1 + 2 + 1 + 1},
        {"group_id": "rc", "n_rollouts": 1, "n_rows": 1, "n_tokens": 2},
    ]
    assert plan_batches(groups, 6) == [["g1"], ["rc"]] and plan_batches(groups, 100) == [["g1", "rc"]]
    assert con.sql(sql_text("trees/iterations"), params={"run_id": "R"}).fetchall() == [(0,)]
