"""The SQL stage (sql/trees/*.sql) on real Parquet partitions through tables.connect."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from clawpipe import schemas, tables
from clawpipe.lake import run_audits
from clawpipe.sqlfiles import sql_text
from clawpipe.trees.reconstruct import build_iteration, plan_batches
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
        ("e1", None, None),  # no group: a group of its own, its group_id stays null
    ]
    assert [r["group_key"] for r in got] == ["g:g1", "g:g1", "g:g1", "r:rc"]
    only = con.sql(sql_text("trees/calls"), params={**params, "all_groups": False, "group_ids": ["r:rc"]})
    assert [r[0] for r in only.fetchall()] == ["e1"]
    groups = con.sql(sql_text("trees/groups"), params={"run_id": "R", "iteration": 0}).to_arrow_table()
    assert groups.to_pylist() == [
        {"group_key": "g:g1", "group_id": "g1", "n_rollouts": 2, "n_rows": 3, "n_tokens": 1 + 1 + 2 + 1 + 1},
        {"group_key": "r:rc", "group_id": None, "n_rollouts": 1, "n_rows": 1, "n_tokens": 2},
    ]
    assert plan_batches(groups, 6) == [["g:g1"], ["r:rc"]] and plan_batches(groups, 100) == [["g:g1", "r:rc"]]
    assert con.sql(sql_text("trees/iterations"), params={"run_id": "R"}).fetchall() == [(0,)]


def _label_lake(lake: Path) -> None:
    p = [1, 2, 3, 4, 5]
    calls = [
        call("a1", "ra", 0, p, [20, 21]),
        call("b1", "rb", 0, p, [30], choice=0),
        call("b1", "rb", 0, p, [20, 21], choice=1),  # n = 2
        call("b2", "rb", 1, p, [40]),  # a real retry
        call("c1", "rc", 0, p, [20, 22, 23, 24]),
        call("c2", "rc", 1, [*p, 20, 22, 99, 8], [25]),  # c1's reply came back re-encoded
    ]
    rolls = [
        {"rollout_id": r, "group_id": "g", "reward": 1.0, "sample_idx": i} for i, r in enumerate(("ra", "rb", "rc"))
    ]
    write_lake(lake, "R", 0, calls, rolls)
    build_iteration(lake, "R", 0)


def test_label_audit_passes_on_built_trees_and_returns_labels_outside_their_rollout(tmp_path: Path) -> None:
    _label_lake(tmp_path)
    con = tables.connect(tmp_path)
    labels = con.sql("select tree_id, branch_cause, count(*) from tree_nodes group by all order by all").fetchall()
    assert ("group:g", "retry", 1) in labels and ("rollout:rb", "choice", 1) in labels
    assert ("group:g", "drift", 1) in labels and ("rollout:rc", "drift", 1) in labels
    assert run_audits(tmp_path)["tree_labels_outside_their_rollout"].num_rows == 0

    # labels as a builder that orders branches across rollouts would give them
    nodes = con.sql("select * from tree_nodes order by tree_id, node_id").to_arrow_table().to_pylist()
    for n in nodes:
        if n["tree_id"] == "group:g" and n["token_ids"][:1] == [30]:
            n["branch_cause"] = "retry"  # rb's first call: no earlier call of rb went elsewhere
        if n["tree_id"] == "rollout:rb" and n["branch_cause"] == "choice":
            n["branch_cause"], n["choice_index"] = "choice", 0  # names the choice that is the main line
        if n["tree_id"] == "group:g" and n["branch_cause"] == "drift":
            n["drift_call_id"] = "a1"  # another rollout's call
    tables.replace_partition(tmp_path, "tree_nodes", "R", 0, pa.Table.from_pylist(nodes, schemas.TREE_NODES))
    bad = run_audits(tmp_path)["tree_labels_outside_their_rollout"].to_pylist()
    got = sorted((b["tree_id"], b["branch_cause"], b["call_id"], b["drift_call_id"]) for b in bad)
    assert got == [
        ("group:g", "drift", "c2", "a1"),
        ("group:g", "retry", "b1", None),
        ("rollout:rb", "choice", "b1", None),
    ]
