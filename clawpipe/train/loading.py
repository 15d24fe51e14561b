"""Training data from the lake: tree_nodes for the layout, model_calls for the sequences, rollouts for rewards.

The trees give the packed layout; each trainable call (ok, upstream token ids) is located in its rollout's
tree as a root-to-token path (CONTRACTS E: every call's sequence is one such path). Calls the trees left out
(retokenized, failed) find no path and are counted, never trained silently. For the harnesses listed in
``exclude_side_calls_harnesses``, calls in a side lineage of their rollout tree (sql/train/side_calls.sql:
titles, memory extraction, sub-agents) are dropped first and counted as ``side_calls_excluded``.
"""

from __future__ import annotations

import logging
import math
import os
from collections import defaultdict

import numpy as np

from clawpipe import tables
from clawpipe.errors import LakeError, TrainingError
from clawpipe.sqlfiles import sql_text
from clawpipe.train.config import TrainConfig
from clawpipe.train.data import RolloutInfo, TrainSequence, TrainTree, locate_sequence, tree_from_nodes

log = logging.getLogger(__name__)


def load_trees(
    lake_root: str | os.PathLike[str], run_id: str, iteration: int, config: TrainConfig
) -> tuple[list[TrainTree], dict[str, RolloutInfo], dict[str, float]]:
    """Trees with their sequences, rollout infos, and load counters."""
    con = tables.connect(lake_root, tables=("tree_nodes", "model_calls", "rollouts"))
    params = {"run_id": run_id, "iteration": int(iteration)}
    try:
        nodes = con.sql(sql_text("train/tree_nodes"), params={**params, "scope": config.tree_scope}).to_arrow_table()
        calls = con.sql(
            sql_text("train/calls"), params={**params, "include_retokenized": config.include_retokenized}
        ).to_arrow_table()
        rolls = con.sql(sql_text("train/rollouts"), params=params).to_arrow_table()
        side: set[tuple[str, int]] = set()
        rollout_trees = True
        if config.exclude_side_calls_harnesses:
            rows = con.execute(
                sql_text("train/side_calls"), {**params, "harnesses": list(config.exclude_side_calls_harnesses)}
            ).fetchall()
            side = {(call_id, int(choice or 0)) for call_id, choice in rows}
            built = con.execute(sql_text("train/rollout_trees"), params).fetchone()
            rollout_trees = bool(built and built[0])
    except Exception as exc:  # duckdb errors: missing columns, unreadable files
        raise LakeError(f"cannot read training data for run {run_id} iteration {iteration}: {exc}") from exc
    finally:
        con.close()
    if nodes.num_rows == 0:
        raise TrainingError(
            f"no {config.tree_scope} trees for run {run_id} iteration {iteration} in {lake_root}: "
            f"build them first (`clawpipe trees build --run {run_id} --iteration {iteration}`)"
        )
    if not rollout_trees:
        raise TrainingError(
            f"exclude_side_calls_harnesses needs the rollout-scope trees of run {run_id} iteration {iteration}: "
            f"build them (`clawpipe trees build --run {run_id} --iteration {iteration}`) or empty the list"
        )
    stats: dict[str, float] = defaultdict(float)
    skip = set(config.skip_statuses)
    infos: dict[str, RolloutInfo] = {}
    skipped_rollouts: set[str] = set()
    for r in rolls.to_pylist():
        if r["status"] in skip:
            skipped_rollouts.add(r["rollout_id"])
            continue
        reward = r["reward"]
        infos[r["rollout_id"]] = RolloutInfo(
            r["rollout_id"],
            r["group_id"] or r["rollout_id"],
            r["harness"] or "unknown",
            float("nan") if reward is None else float(reward),
        )
    stats["rollouts_skipped_status"] = len(skipped_rollouts)

    calls_by_rollout: dict[str, list[dict]] = defaultdict(list)
    stats["side_calls_excluded"] = 0
    for c in calls.to_pylist():
        if side and (c["call_id"], int(c["choice_index"] or 0)) in side:
            stats["side_calls_excluded"] += 1
            continue
        calls_by_rollout[c["rollout_id"]].append(c)

    trees: list[TrainTree] = []
    cols = nodes.to_pydict()
    bounds = _runs(cols["tree_id"])
    for start, end in bounds:
        tree_id = cols["tree_id"][start]
        tree = tree_from_nodes(
            tree_id, cols["node_id"][start:end], cols["parent_id"][start:end], cols["token_ids"][start:end]
        )
        rids = sorted({r for ids in cols["rollout_ids"][start:end] if ids for r in ids})
        kids = tree.children()
        for rid in rids:
            if rid in skipped_rollouts:
                stats["calls_skipped_status"] += len(calls_by_rollout.get(rid, ()))
                continue
            for c in calls_by_rollout.get(rid, ()):
                seq = _sequence(tree, kids, c, stats)
                if seq is not None:
                    tree.sequences.append(seq)
        if tree.sequences:
            trees.append(tree)
        else:
            stats["trees_without_sequences"] += 1
    stats["trees_loaded"] = len(trees)
    return trees, infos, dict(stats)


def _runs(values: list[str]) -> list[tuple[int, int]]:
    out, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            out.append((start, i))
            start = i
    return out


def _sequence(tree: TrainTree, kids: list[list[int]], call: dict, stats: dict[str, float]) -> TrainSequence | None:
    prompt = call["prompt_token_ids"] or []
    completion = call["completion_token_ids"] or []
    lps = call["completion_logprobs"]
    if lps is None or len(lps) != len(completion) or any(x is None or not math.isfinite(x) for x in lps):
        stats["calls_without_logprobs"] += 1
        return None
    tokens = np.asarray(list(prompt) + list(completion), dtype=np.int64)
    positions = locate_sequence(tree, kids, tokens)
    if positions is None:
        stats["calls_not_in_tree"] += 1
        return None
    stats["calls"] += 1
    return TrainSequence(
        call_id=call["call_id"],
        rollout_id=call["rollout_id"],
        positions=positions,
        n_prompt=len(prompt),
        old_logprobs=np.asarray(lps, dtype=np.float32),
        policy_version=call["policy_version"],
        choice_index=int(call["choice_index"] or 0),
    )
