"""Training data from the lake: tree_nodes for the layout, tree_sequences for where each call lies, model_calls
for its logprobs, rollouts for rewards.

The trees give the packed layout and, per call x choice, the node where its path ends (tree_sequences, written
with the trees); each trainable call (ok, upstream token ids) is placed there (clawpipe.train.data). Calls the
trees left out (retokenized, failed) have no link and are counted, never trained silently. For the harnesses listed in
``exclude_side_calls_harnesses``, calls in a side lineage of their rollout tree (sql/train/side_calls.sql:
titles, memory extraction, sub-agents) are dropped first and counted as ``side_calls_excluded``. A call
with a captured logprob no sampled token can have (LOGPROB_FLOOR, LOGPROB_CEILING) is left out and counted
as ``calls_logprobs_out_of_range``: one such token would make the whole step's gradient NaN.
"""

from __future__ import annotations

import logging
import math
import os
from collections import defaultdict

from clawpipe import tables
from clawpipe.errors import LakeError, TrainingError
from clawpipe.sqlfiles import sql_text
from clawpipe.train.config import TrainConfig
from clawpipe.train.data import RolloutInfo, TrainTree, attach_sequences, flatten_nodes

log = logging.getLogger(__name__)

# Captured logprobs a sampled token can have. Below the floor a token was never sampled from what the logprob
# describes: a sentinel (an engine writes -inf as -9999.0 in JSON) or a broken upstream. The loss's ratio
# exp(current - captured) overflows float32 beyond exp(88.7), so one such token made the whole step's gradient
# NaN; its call is left out and counted instead. Above the ceiling it is no log-probability at all.
LOGPROB_FLOOR = -80.0
LOGPROB_CEILING = 1e-3  # rounding in an engine's log-softmax can leave a sure token slightly above 0


def load_trees(
    lake_root: str | os.PathLike[str], run_id: str, iteration: int, config: TrainConfig
) -> tuple[list[TrainTree], dict[str, RolloutInfo], dict[str, float]]:
    """Trees with their sequences, rollout infos, and load counters."""
    # pinned to the iteration's files: a view over the whole lake opens every file of its table when made
    con = tables.connect(
        lake_root,
        tables=("tree_nodes", "tree_sequences", "model_calls", "rollouts"),
        partition=(run_id, int(iteration)),
    )
    params = {"run_id": run_id, "iteration": int(iteration)}
    try:
        nodes = con.sql(sql_text("train/tree_nodes"), params={**params, "scope": config.tree_scope}).to_arrow_table()
        calls = con.sql(
            sql_text("train/sequences"),
            params={**params, "scope": config.tree_scope, "include_retokenized": config.include_retokenized},
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
    if calls.num_rows and calls["tree_id"].null_count == calls.num_rows:
        raise TrainingError(
            f"the {config.tree_scope} trees of run {run_id} iteration {iteration} link none of its calls "
            f"(tree_sequences missing or stale): rebuild them (`clawpipe trees build --run {run_id} "
            f"--iteration {iteration}`)"
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
            r["group_id"] or None,  # no group (null or empty): a group of its own (advantages.group_key)
            r["harness"] or "unknown",
            float("nan") if reward is None else float(reward),
        )
    stats["rollouts_skipped_status"] = len(skipped_rollouts)
    if calls.num_rows and rolls.num_rows == 0:
        raise TrainingError(
            f"run {run_id} iteration {iteration} has calls but no rows in rollouts: land its results first "
            f"(`clawpipe lake land`) so every call has its rollout's reward"
        )

    links: dict[str, list[dict]] = defaultdict(list)
    stats["side_calls_excluded"] = 0
    stats["calls_stale_dropped"] = 0
    stats["calls_without_rollout"] = 0
    orphans: set[str] = set()
    odd_logprobs: list[str] = []
    for c in calls.to_pylist():
        if side and (c["call_id"], int(c["choice_index"] or 0)) in side:
            stats["side_calls_excluded"] += 1
        elif c["rollout_id"] in skipped_rollouts:
            stats["calls_skipped_status"] += 1
        elif c["rollout_id"] not in infos:
            # a rollout cut off before its result (a killed run reruns it under a new id): no reward
            stats["calls_without_rollout"] += 1
            orphans.add(c["rollout_id"])
        elif (c["policy_version"] or 0) < config.min_policy_version:
            stats["calls_stale_dropped"] += 1
        elif not _logprobs_ok(c):
            stats["calls_without_logprobs"] += 1
        elif not _logprobs_in_range(c["completion_logprobs"]):
            stats["calls_logprobs_out_of_range"] += 1
            odd_logprobs.append(c["call_id"])
        elif c["tree_id"] is None:
            stats["calls_not_in_tree"] += 1
        else:
            links[c["tree_id"]].append(c)

    trees: list[TrainTree] = []
    cols = nodes.to_pydict()
    for start, end in _runs(cols["tree_id"]):
        tree_id = cols["tree_id"][start]
        tree, layout = flatten_nodes(
            tree_id, cols["node_id"][start:end], cols["parent_id"][start:end], cols["token_ids"][start:end]
        )
        attach_sequences(tree, layout, links.get(tree_id, ()), stats)
        if tree.sequences:
            trees.append(tree)
        else:
            stats["trees_without_sequences"] += 1
    stats["trees_loaded"] = len(trees)
    if orphans:
        log.warning(
            "run %s iteration %d: %d calls of %d rollouts without a result row left out of training "
            "(cut off before they finished; first: %s)",
            run_id, iteration, int(stats["calls_without_rollout"]), len(orphans), min(orphans),
        )  # fmt: skip
    if odd_logprobs:
        log.warning(
            "run %s iteration %d: %d calls left out of training: a captured logprob outside [%g, %g] (first: %s)",
            run_id, iteration, len(odd_logprobs), LOGPROB_FLOOR, LOGPROB_CEILING, odd_logprobs[0],
        )  # fmt: skip
    return trees, infos, dict(stats)


def _runs(values: list[str]) -> list[tuple[int, int]]:
    out, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            out.append((start, i))
            start = i
    return out


def _logprobs_in_range(lps: list[float]) -> bool:
    return min(lps, default=0.0) >= LOGPROB_FLOOR and max(lps, default=0.0) <= LOGPROB_CEILING


def _logprobs_ok(call: dict) -> bool:
    lps = call["completion_logprobs"]
    return lps is not None and len(lps) == call["n_completion"] and all(x is not None and math.isfinite(x) for x in lps)
