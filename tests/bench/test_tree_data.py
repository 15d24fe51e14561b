"""The benches' tree input (bench/tree_data.py): production-shaped groups that the trees room builds into
realistically shared and branched trees."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import data
import tree_data

from clawpipe.trees import build_forest


def _rows(n_groups: int, shp: data.Shape, **kw: object) -> list[list[dict]]:
    return list(tree_data.groups(n_groups, shp, **kw))  # type: ignore[arg-type]


def test_groups_share_their_task_prompt_and_nothing_is_copied() -> None:
    groups = _rows(6, data.Shape(600, 64, 4))
    firsts = []
    for group in groups:
        by_rollout: dict[str, list[dict]] = {}
        for row in group:
            by_rollout.setdefault(row["rollout_id"], []).append(row)
        assert len(by_rollout) == 8
        task = {r[0]["prompt_token_ids"].tobytes() for r in by_rollout.values()}
        assert len(task) == 1, "every rollout of a group starts from the group's task prompt"
        firsts.append(task.pop())
    assert len(set(firsts)) == len(groups), "each group has its own task"
    calls = [(r["prompt_token_ids"].tobytes(), r["completion_token_ids"].tobytes()) for g in groups for r in g]
    sampled = [c for c in calls if c[1]]
    assert len(set(sampled)) == len(sampled), "no call is a copy of another"
    ids = np.concatenate([r["completion_token_ids"] for g in groups for r in g])
    assert ids.min() >= 0 and ids.max() < data.VOCAB
    assert len(np.unique(ids)) > len(ids) // 10  # Zipf-like: common ids repeat, the tail is long


def test_trees_of_the_data_share_prefixes_and_show_every_branch_cause() -> None:
    br = tree_data.Branching(retry=0.2, choices=0.2, drift=0.3, subagent=0.5)
    shp = data.Shape(800, 64, 6, context=2000)
    rows = [r for g in _rows(6, shp, branching=br) for r in g]
    forest = build_forest(tree_data.table(rows), run_id="r", iteration=0)
    rollouts = forest.stats.filter(pc.equal(forest.stats["scope"], "rollout"))
    groups = forest.stats.filter(pc.equal(forest.stats["scope"], "group"))
    flattened = sum(len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) for r in rows)
    unique_r = pc.sum(rollouts["unique_tokens"]).as_py()
    unique_g = pc.sum(groups["unique_tokens"]).as_py()
    assert flattened > 2 * unique_r, "multi-turn prompts re-send earlier turns"
    assert unique_g < unique_r, "a group's rollouts share their task prompt"
    for cause in ("retry", "choice", "drift", "subagent", "rewrite"):
        assert pc.sum(rollouts[f"branches_{cause}"]).as_py() > 0, cause


def test_prompts_over_the_context_are_compacted_into_the_task_and_a_summary() -> None:
    shp = data.Shape(3000, 200, 10, context=4000)
    rows = [r for g in _rows(3, shp) for r in g]
    assert max(len(r["prompt_token_ids"]) for r in rows) <= 4000 - 4 * shp.sampled
    compacted = 0
    for a, b in itertools.pairwise(rows):
        same = a["rollout_id"] == b["rollout_id"]
        pa_, pb = a["prompt_token_ids"], b["prompt_token_ids"]
        if same and len(pb) < len(pa_) and not np.array_equal(pb[: len(pa_)], pa_):
            compacted += 1
    assert compacted > 0
