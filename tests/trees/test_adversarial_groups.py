"""Group keys from ids the lake accepts as they come: a rollout without a group whose rollout id is another
group's id stays apart from that group, in the trees, in the advantages and in the pipeline's group count."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from clawpipe import tables
from clawpipe.sqlfiles import sql_text
from clawpipe.train.batch import build_batch
from clawpipe.train.config import make_config
from clawpipe.train.data import RolloutInfo
from clawpipe.train.loading import load_trees
from clawpipe.trees import build_iteration
from tests.trees.fixtures import call, read_stats, rollout, write_lake

RUN = "run-g"
PROMPT = [1, 2, 3, 4, 5, 6]


def _collision_lake(lake: Path) -> None:
    """Group "g1" of rollouts a (reward 1) and b (reward 0) beside the groupless rollouts "g1" and "c"
    (reward 1 each); every rollout answers the same prompt, so merged they would share one tree."""
    calls = [
        call("ca", "a", 0, PROMPT, [20, 21]),
        call("cb", "b", 0, PROMPT, [30, 31]),
        call("cg", "g1", 0, PROMPT, [40, 41]),
        call("cc", "c", 0, PROMPT, [50, 51]),
    ]
    rolls = [rollout("a", "g1", 1.0, 0), rollout("b", "g1", 0.0, 1), rollout("g1", None, 1.0), rollout("c", "", 1.0)]
    write_lake(lake, RUN, 0, calls, [{**r, "harness": "h"} for r in rolls])


@pytest.mark.parametrize("token_budget", [10**9, 1])  # all groups in one batch, or one group per batch
def test_a_groupless_rollout_named_like_a_group_gets_trees_of_its_own(tmp_path: Path, token_budget: int) -> None:
    _collision_lake(tmp_path)
    build_iteration(tmp_path, RUN, 0, token_budget=token_budget)
    stats = read_stats(tmp_path, RUN, 0)
    assert set(stats) == {
        "group:g1", "group-of:g1", "group-of:c", "rollout:a", "rollout:b", "rollout:g1", "rollout:c",
    }  # fmt: skip
    assert stats["group:g1"]["n_seqs"] == 2 and stats["group:g1"]["group_id"] == "g1"
    assert stats["group-of:g1"]["n_seqs"] == 1 and stats["group-of:g1"]["group_id"] is None
    # columns that show group ids show the real one, or null for a rollout without a group
    assert [stats[f"rollout:{r}"]["group_id"] for r in ("a", "b", "g1", "c")] == ["g1", "g1", None, None]
    con = tables.connect(tmp_path)
    rows = con.sql(
        "select tree_id, list_sort(list_distinct(flatten(list(rollout_ids)))) from tree_nodes "
        "where scope = 'group' group by tree_id order by tree_id"
    ).fetchall()
    assert rows == [("group-of:c", ["c"]), ("group-of:g1", ["g1"]), ("group:g1", ["a", "b"])]


@pytest.mark.parametrize("group_by", ["group_id", "group_id+harness"])
def test_a_groupless_rollout_named_like_a_group_is_normalised_apart(tmp_path: Path, group_by: str) -> None:
    _collision_lake(tmp_path)
    build_iteration(tmp_path, RUN, 0)
    config = make_config(group_by=group_by)
    trees, infos, _ = load_trees(tmp_path, RUN, 0, config)
    assert infos["g1"].group_id is None and infos["a"].group_id == "g1" and infos["c"].group_id is None
    batch = build_batch(trees, infos, config, policy_version=None)
    # two groups of one (zero variance, left out) and g1 of a and b: mean 0.5, not 2/3 with "g1" merged in
    assert batch.stats["groups"] == 3 and batch.stats["groups_skipped_zero_variance"] == 2
    assert [t.tree_id for t in batch.trees] == ["group:g1"]
    assert sorted(i.rollout_id for i in batch.rollouts) == ["a", "b"]
    adv = {batch.rollouts[r].rollout_id: a for r, a in zip(batch.contrib.rollout, batch.contrib.adv, strict=True)}
    assert adv == pytest.approx({"a": 0.5, "b": -0.5})


def test_group_and_harness_keys_do_not_run_into_each_other() -> None:
    from tests.trees.training import build_tree

    # ("x\x1fy", "z") and ("x", "y\x1fz") joined with the separator are the same text
    seqs = [dict(tokens=[1, 2, 10 + k, 20 + k], n_prompt=2, rollout_id=f"r{k}") for k in range(4)]
    tree = build_tree("group:any", seqs)
    infos = {
        "r0": RolloutInfo("r0", "x\x1fy", "z", 1.0),
        "r1": RolloutInfo("r1", "x\x1fy", "z", 0.0),
        "r2": RolloutInfo("r2", "x", "y\x1fz", 1.0),
        "r3": RolloutInfo("r3", "x", "y\x1fz", 1.0),
    }
    batch = build_batch([tree], infos, make_config(group_by="group_id+harness"), policy_version=None)
    assert batch.stats["groups"] == 2 and batch.stats["groups_skipped_zero_variance"] == 1
    assert sorted(i.rollout_id for i in batch.rollouts) == ["r0", "r1"]
    assert np.allclose(sorted(set(batch.contrib.adv.tolist())), [-0.5, 0.5])


def test_landed_groups_count_each_groupless_rollout_as_a_group_of_its_own(tmp_path: Path) -> None:
    _collision_lake(tmp_path)
    con = tables.connect(tmp_path)
    got = con.sql(sql_text("pipeline/landed_groups"), params={"run_id": RUN, "iteration": 0}).fetchall()
    assert sorted(got, key=repr) == sorted([("g1", 2), (None, 1), (None, 1)], key=repr)
