"""The reconstruct stage: lake model_calls + rollouts -> prefix trees -> lake tree_nodes, tree_stats, tree_sequences.

SQL (``sql/trees/*.sql``) selects and orders the calls; Python (:mod:`clawpipe.trees.forest`) builds the
trees. Groups are read in batches of whole groups bounded by a token budget, so memory follows the largest
group rather than the whole iteration. Each (run, iteration) partition of the three tables is replaced
whole, so a rerun (or a Prefect retry) rewrites, never duplicates. tree_sequences is the call-to-path link
(each call x choice's tree and end node), so training need not search the trees for its calls.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import pyarrow as pa

from clawpipe import tables
from clawpipe.errors import LakeError
from clawpipe.schemas import TREE_NODES, TREE_SEQUENCES, TREE_STATS
from clawpipe.sqlfiles import sql_text
from clawpipe.trees.forest import SCOPES, build_forest

log = logging.getLogger(__name__)

DEFAULT_TOKEN_BUDGET = 64_000_000  # tokens (prompt + completion) read per batch of groups (~256 MB of ids)


@dataclass
class BuildSummary:
    """What one (run, iteration) reconstruction wrote."""

    run_id: str
    iteration: int
    n_trees: int
    n_nodes: int
    n_calls: int
    flattened_tokens: int  # rollout-scope trees
    unique_tokens: int  # rollout-scope trees
    branches: dict[str, int]  # rollout-scope trees, by cause (group trees add branches_rollout)
    drift_count: int
    failed_calls: int  # status other than ok (in the trees as context when their prompt ids are exact)
    truncated_calls: int
    kept_out_retokenized: int  # calls kept out of the trees: ids re-encoded by the proxy
    kept_out_no_ids: int  # calls kept out of the trees: no prompt ids
    spliced_tokens: int  # prompt ids the engine carried over from the rollouts' earlier completions
    seconds: float


def plan_batches(groups: pa.Table, token_budget: int) -> list[list[str]]:
    """Split groups (group_key, n_tokens) into batches of whole groups' keys of at most ``token_budget`` tokens."""
    batches: list[list[str]] = []
    current: list[str] = []
    used = 0
    for gid, n in zip(groups["group_key"].to_pylist(), groups["n_tokens"].to_pylist(), strict=True):
        n = int(n or 0)
        if current and used + n > token_budget:
            batches.append(current)
            current, used = [], 0
        current.append(gid)
        used += n
    if current:
        batches.append(current)
    return batches


def list_iterations(lake_root: str | os.PathLike[str], run_id: str) -> list[int]:
    """Iterations of ``run_id`` that have captured calls."""
    con = tables.connect(lake_root, tables=("model_calls",))
    return [int(r[0]) for r in con.execute(sql_text("trees/iterations"), {"run_id": run_id}).fetchall()]


def build_iteration(
    lake_root: str | os.PathLike[str],
    run_id: str,
    iteration: int,
    *,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    scopes: tuple[str, ...] = SCOPES,
) -> BuildSummary:
    """Rebuild the trees of one run iteration and replace its tree_nodes, tree_stats and tree_sequences."""
    t0 = time.perf_counter()
    # pinned to the iteration's files: a view over the whole lake opens every file of its table when made
    con = tables.connect(lake_root, tables=("model_calls", "rollouts"), partition=(run_id, int(iteration)))
    params = {"run_id": run_id, "iteration": int(iteration)}
    groups = con.sql(sql_text("trees/groups"), params=params).to_arrow_table()
    batches = plan_batches(groups, token_budget)
    node_parts: list[pa.Table] = []
    stat_parts: list[pa.Table] = []
    seq_parts: list[pa.Table] = []
    for k, batch in enumerate(batches):
        calls = con.sql(
            sql_text("trees/calls"), params={**params, "all_groups": len(batches) == 1, "group_ids": batch}
        ).to_arrow_table()
        forest = build_forest(calls, run_id=run_id, iteration=int(iteration), scopes=scopes)
        del calls
        node_parts.append(forest.nodes)
        stat_parts.append(forest.stats)
        seq_parts.append(forest.sequences)
        log.debug("trees batch run_id=%s iteration=%s batch=%d groups=%d", run_id, iteration, k, len(batch))
    nodes = pa.concat_tables(node_parts) if node_parts else TREE_NODES.empty_table()
    stats = pa.concat_tables(stat_parts) if stat_parts else TREE_STATS.empty_table()
    sequences = pa.concat_tables(seq_parts) if seq_parts else TREE_SEQUENCES.empty_table()
    tables.replace_partition(lake_root, "tree_nodes", run_id, int(iteration), nodes)
    tables.replace_partition(lake_root, "tree_stats", run_id, int(iteration), stats)
    tables.replace_partition(lake_root, "tree_sequences", run_id, int(iteration), sequences)
    summary = _summarise(run_id, int(iteration), nodes, stats, time.perf_counter() - t0)
    log.info(
        "trees built run_id=%s iteration=%s trees=%d nodes=%d calls=%d drift=%d failed=%d kept_out_retokenized=%d "
        "kept_out_no_ids=%d seconds=%.2f",
        run_id,
        iteration,
        summary.n_trees,
        summary.n_nodes,
        summary.n_calls,
        summary.drift_count,
        summary.failed_calls,
        summary.kept_out_retokenized,
        summary.kept_out_no_ids,
        summary.seconds,
    )
    return summary


def build_trees(
    lake_root: str | os.PathLike[str],
    run_id: str,
    iteration: int | None = None,
    *,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    scopes: tuple[str, ...] = SCOPES,
) -> list[BuildSummary]:
    """Rebuild the trees of one iteration of a run, or of every iteration that has calls (``iteration=None``)."""
    iterations = [int(iteration)] if iteration is not None else list_iterations(lake_root, run_id)
    if not iterations:
        raise LakeError(f"run {run_id!r} has no model_calls in lake {lake_root}; land its captures first")
    return [build_iteration(lake_root, run_id, it, token_budget=token_budget, scopes=scopes) for it in iterations]


def _summarise(run_id: str, iteration: int, nodes: pa.Table, stats: pa.Table, seconds: float) -> BuildSummary:
    rows = [s for s in stats.to_pylist() if s["scope"] == "rollout"]
    causes = ("retry", "choice", "rewrite", "subagent", "drift")
    branches = {c: sum(s[f"branches_{c}"] for s in rows) for c in causes}
    branches["rollout"] = sum(s["branches_rollout"] for s in stats.to_pylist() if s["scope"] == "group")
    return BuildSummary(
        run_id=run_id,
        iteration=iteration,
        n_trees=len(stats),
        n_nodes=len(nodes),
        n_calls=sum(s["n_calls"] for s in rows),
        flattened_tokens=sum(s["flattened_tokens"] for s in rows),
        unique_tokens=sum(s["unique_tokens"] for s in rows),
        branches=branches,
        drift_count=sum(s["drift_count"] for s in rows),
        failed_calls=sum(s["failed_calls"] for s in rows),
        truncated_calls=sum(s["truncated_calls"] for s in rows),
        kept_out_retokenized=sum(s["kept_out_retokenized"] for s in rows),
        kept_out_no_ids=sum(s["kept_out_no_ids"] for s in rows),
        spliced_tokens=sum(s["spliced_tokens"] for s in rows),
        seconds=seconds,
    )
