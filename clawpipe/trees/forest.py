"""All prefix trees of a batch of calls: Arrow in (the SQL stage's rows), Arrow out (the three tree tables).

:func:`build_forest` takes the rows of ``sql/trees/calls.sql`` (one per call x choice, with the rollout's
group and reward), keeps calls without exact ids out of the trees (a failed call's prompt goes in as
context), builds one tree per rollout and one per group (:mod:`clawpipe.trees.prefix_tree`) group by group,
and lays every node's tokens and logprobs out with one vectorised gather per batch. The rows are sorted
first (:mod:`clawpipe.trees.calls`), so the result does not depend on the order they arrive in.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from clawpipe.errors import TreeError
from clawpipe.schemas import TREE_NODES, TREE_SEQUENCES, TREE_STATS
from clawpipe.trees.calls import CallBatch, prepare
from clawpipe.trees.labels import CAUSES, DRIFT
from clawpipe.trees.prefix_tree import TreeNodes, TreeSequences, build_tree
from clawpipe.trees.shapes import Keys

log = logging.getLogger(__name__)

SCOPES = ("rollout", "group")


class Forest(NamedTuple):
    """What :func:`build_forest` returns: the rows of tree_nodes, tree_stats and tree_sequences."""

    nodes: pa.Table
    stats: pa.Table
    sequences: pa.Table


def tree_id_of(scope: str, key: str) -> str:
    """The tree_id of the rollout tree of ``key`` (a rollout_id) or the group tree of ``key`` (a group_id)."""
    return f"{scope}:{key}"


def group_tree_id(group_id: str | None, rollout_id: str) -> str:
    """The group tree's id: ``group:<group_id>``, or ``group-of:<rollout_id>`` for a rollout without a group
    (a group of its own), which ``group:<rollout_id>`` would confuse with the group of that name."""
    return tree_id_of("group", group_id) if group_id is not None else f"group-of:{rollout_id}"


@dataclass
class _Acc:
    """Per-node arrays of every tree built so far (concatenated at the end), plus tree_stats rows."""

    tree: list[np.ndarray] = field(default_factory=list)  # tree index per node
    parts: dict[str, list[np.ndarray]] = field(default_factory=dict)
    rollout_lists: list[list[int]] = field(default_factory=list)
    leaf_rewards: list[float] = field(default_factory=list)
    tree_ids: list[str] = field(default_factory=list)
    scopes: list[str] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)
    seq_tree: list[np.ndarray] = field(default_factory=list)  # tree index per sequence
    seq_row: list[np.ndarray] = field(default_factory=list)  # batch row per sequence
    seq_end: list[np.ndarray] = field(default_factory=list)  # end node per sequence

    def add(self, name: str, arr: np.ndarray) -> None:
        self.parts.setdefault(name, []).append(arr)

    def cat(self, name: str, dtype: type) -> np.ndarray:
        got = self.parts.get(name)
        return np.concatenate(got).astype(dtype, copy=False) if got else np.zeros(0, dtype)


def _to_rows(rows: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Tree-local sequence indices -> batch rows, keeping -1."""
    return np.where(idx >= 0, rows[np.maximum(idx, 0)], -1)


def _sequences(b: CallBatch, rows: np.ndarray) -> TreeSequences:
    """The tree input of batch rows (already restricted to rows in the tree), in their order; keys are built
    when the builder asks for them."""
    return TreeSequences(
        keys=Keys(rows.tolist(), b.key, b.key_length),
        plen=b.prompt.length[rows].tolist(),
        glen=b.glen[rows].tolist(),
        call=b.call_code[rows].tolist(),
        rollout=b.rollout_code[rows].tolist(),
    )


def _add_tree(
    acc: _Acc,
    b: CallBatch,
    scope: str,
    tid: str,
    group: str | None,
    rollout: str | None,
    all_rows: np.ndarray,
    nodes: TreeNodes | None,
) -> None:
    """Append one built tree (``nodes``: None when no row of ``all_rows`` is in the tree) and its stats."""
    rows = all_rows[b.in_tree[all_rows]]
    t = len(acc.tree_ids)
    acc.tree_ids.append(tid)
    acc.scopes.append(scope)
    n = 0 if nodes is None else len(nodes.start)
    causes = np.zeros(len(CAUSES) + 1, dtype=np.int64)
    if nodes is not None:
        acc.tree.append(np.full(n, t, dtype=np.int64))
        acc.add("start", nodes.start)
        acc.add("end", nodes.end)
        acc.add("parent", nodes.parent)
        acc.add("rep_row", rows[nodes.rep])
        acc.add("gen_row", _to_rows(rows, nodes.gen))
        acc.add("n_gen", nodes.n_gen)
        acc.add("n_seqs", nodes.n_seqs)
        acc.add("n_leaves", nodes.n_leaves)
        acc.add("is_leaf", nodes.is_leaf)
        acc.add("cause", nodes.cause)
        acc.add("cause_row", _to_rows(rows, nodes.cause_seq))
        acc.add("drift_row", _to_rows(rows, nodes.drift_seq))
        acc.rollout_lists.extend(nodes.rollouts)
        acc.seq_tree.append(np.full(len(rows), t, dtype=np.int64))
        acc.seq_row.append(rows)
        acc.seq_end.append(nodes.end_node)
        rr = b.reward_of_rollout
        for leaf, lr in zip(nodes.is_leaf.tolist(), nodes.leaf_rollouts, strict=True):
            vals = [rr[r] for r in lr if not np.isnan(rr[r])] if leaf else []
            acc.leaf_rewards.append(_mean(vals) if vals else np.nan)
        causes = np.bincount(nodes.cause, minlength=len(CAUSES) + 1)
    flattened = int((b.prompt.length[rows] + b.glen[rows]).sum())
    unique = 0 if nodes is None else int((nodes.end - nodes.start).sum())
    calls = b.call_code[all_rows]
    acc.stats.append(
        {
            "tree_id": tid,
            "scope": scope,
            "group_id": group,
            "rollout_id": rollout,
            "n_calls": len(set(calls.tolist())),
            "n_seqs": len(rows),
            "flattened_tokens": flattened,
            "unique_tokens": unique,
            "redundancy": flattened / unique if unique else None,
            "n_nodes": n,
            "n_leaves": 0 if nodes is None else int(nodes.is_leaf.sum()),
            **{f"branches_{c}": int(causes[i + 1]) for i, c in enumerate(CAUSES)},
            "drift_count": 0 if nodes is None else nodes.drift_affected,
            "failed_calls": len(set(calls[b.failed[all_rows]].tolist())),
            "truncated_calls": len(set(calls[b.truncated[all_rows]].tolist())),
            "kept_out_retokenized": len(set(calls[b.retokenized[all_rows]].tolist())),
            "kept_out_no_ids": len(set(calls[b.no_ids[all_rows]].tolist())),
            "spliced_tokens": _spliced(b, all_rows),
        }
    )


def _mean(vals: list[float]) -> float:
    """The mean of finite rewards; near the float64 limit their sum overflows, so then each is divided first."""
    vs = [float(v) for v in vals]  # Python floats: an overflowing sum is inf, without a numpy warning
    m = sum(vs) / len(vs)
    return m if math.isfinite(m) else sum(v / len(vs) for v in vs)


def _spliced(b: CallBatch, rows: np.ndarray) -> int:
    """Prompt ids the engine carried over from earlier completions, once per call (its choices share a prompt)."""
    _, first = np.unique(b.call_code[rows], return_index=True)
    return int(b.spliced[rows[first]].sum())


def build_forest(calls: pa.Table, *, run_id: str, iteration: int, scopes: tuple[str, ...] = SCOPES) -> Forest:
    """Trees of every rollout and group in ``calls``: the tree_nodes, tree_stats and tree_sequences rows."""
    bad = [s for s in scopes if s not in SCOPES]
    if bad:
        raise TreeError(f"unknown tree scope(s) {bad}; choose from {SCOPES}")
    acc = _Acc()
    if len(calls):
        b = prepare(calls)
        bounds = np.flatnonzero(np.diff(b.group_code)) + 1
        for g_rows in np.split(np.arange(len(b.group_code)), bounds):
            group = b.table["group_id"][int(g_rows[0])].as_py()  # the real one: None without a group
            # the rollout trees come first: a group tree's branches take their labels from them
            per_rollout: dict[int, TreeNodes] = {}
            rc = b.rollout_code[g_rows]
            for r_rows in np.split(g_rows, np.flatnonzero(np.diff(rc)) + 1):
                code = int(b.rollout_code[r_rows[0]])
                rows = r_rows[b.in_tree[r_rows]]
                r_nodes = build_tree(_sequences(b, rows)) if len(rows) else None
                if r_nodes is not None:
                    per_rollout[code] = r_nodes
                if "rollout" in scopes:
                    rid = b.rollout_ids[code]
                    _add_tree(acc, b, "rollout", tree_id_of("rollout", rid), group, rid, r_rows, r_nodes)
            if "group" in scopes:
                rows = g_rows[b.in_tree[g_rows]]
                g_seqs = _sequences(b, rows)
                g_nodes = build_tree(g_seqs, group_scope=True, rollout_trees=per_rollout) if len(rows) else None
                tid = group_tree_id(group, b.rollout_ids[int(b.rollout_code[g_rows[0]])])
                _add_tree(acc, b, "group", tid, group, None, g_rows, g_nodes)
        nodes = _assemble(acc, b, run_id, iteration)
        sequences = _sequence_rows(acc, b, run_id, iteration)
    else:
        nodes, sequences = TREE_NODES.empty_table(), TREE_SEQUENCES.empty_table()
    stats = pa.Table.from_pylist(
        [{"run_id": run_id, "iteration": iteration, **s} for s in acc.stats], schema=TREE_STATS
    )
    return Forest(nodes, stats, sequences)


def _take_str(col: pa.ChunkedArray, rows: np.ndarray) -> pa.Array:
    idx = pa.array(np.maximum(rows, 0), mask=rows < 0)
    return pc.take(col, idx)


def _assemble(acc: _Acc, b: CallBatch, run_id: str, iteration: int) -> pa.Table:
    if not acc.tree:
        return TREE_NODES.empty_table()
    tree = np.concatenate(acc.tree)
    start, end = acc.cat("start", np.int64), acc.cat("end", np.int64)
    rep, gen = acc.cat("rep_row", np.int64), acc.cat("gen_row", np.int64)
    cause, cause_row, drift_row = (
        acc.cat("cause", np.int8),
        acc.cat("cause_row", np.int64),
        acc.cat("drift_row", np.int64),
    )
    length = end - start
    off = np.zeros(len(length) + 1, dtype=np.int64)
    np.cumsum(length, out=off[1:])
    # A context node lies inside the prompt of every sequence through it; a generated node inside its
    # generator's completion: so each node is one contiguous slice of the prompt or the completion values.
    generated = gen >= 0
    src = np.where(generated, gen, rep)
    g_start = b.completion.offset[src] + start - b.prompt.length[src]
    p_start = b.prompt.offset[src] + start
    p_vals, c_vals = b.prompt.values, b.completion.values
    pieces = [
        c_vals[a : a + n] if g else p_vals[q : q + n]
        for g, a, q, n in zip(generated.tolist(), g_start.tolist(), p_start.tolist(), length.tolist(), strict=True)
    ]
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    token_ids = pa.ListArray.from_arrays(pa.array(off.astype(np.int32)), pa.array(tokens.astype(np.int32)))

    g_len = np.where(generated, length, 0)
    g_off = np.zeros(len(g_len) + 1, dtype=np.int64)
    np.cumsum(g_len, out=g_off[1:])
    lp_ok = b.logprobs.length[src] == b.completion.length[src]
    lp_start = b.logprobs.offset[src] + start - b.prompt.length[src]
    lp_vals = b.logprobs.values
    lp_pieces = [
        lp_vals[a : a + n] if ok else np.full(n, np.nan, dtype=np.float32)
        for g, ok, a, n in zip(generated.tolist(), lp_ok.tolist(), lp_start.tolist(), length.tolist(), strict=True)
        if g
    ]
    lp = np.concatenate(lp_pieces) if lp_pieces else np.zeros(0, np.float32)
    logprobs = pa.ListArray.from_arrays(
        pa.array(g_off.astype(np.int32)), pa.array(lp.astype(np.float32)), mask=pa.array(~generated)
    )

    r_len = np.fromiter((len(r) for r in acc.rollout_lists), dtype=np.int64, count=len(acc.rollout_lists))
    r_off = np.zeros(len(r_len) + 1, dtype=np.int32)
    np.cumsum(r_len, out=r_off[1:])
    r_flat = np.fromiter((x for r in acc.rollout_lists for x in r), dtype=np.int64, count=int(r_off[-1]))
    rollout_ids = pa.ListArray.from_arrays(pa.array(r_off), pa.array(b.rollout_ids, pa.string()).take(r_flat))

    label_row = np.where(generated, gen, np.where(cause == DRIFT, cause_row, -1))
    cause_names = np.array([None, *CAUSES], dtype=object)[cause]
    tbl = b.table
    cols = {
        "run_id": pa.array(np.full(len(tree), run_id, dtype=object), pa.string()),
        "iteration": pa.array(np.full(len(tree), iteration, dtype=np.int32)),
        "tree_id": pa.array(acc.tree_ids, pa.string()).take(tree),
        "scope": pa.array(acc.scopes, pa.string()).take(tree),
        "node_id": pa.array(np.concatenate([np.arange(len(x)) for x in acc.tree]).astype(np.int32)),
        "parent_id": pa.array(acc.cat("parent", np.int32)),
        "depth": pa.array(start.astype(np.int32)),
        "token_ids": token_ids,
        "generated": pa.array(generated),
        "logprobs": logprobs,
        "call_id": _take_str(tbl["call_id"], label_row),
        "choice_index": _take_str(tbl["choice_index"], label_row),
        "policy_version": _take_str(tbl["policy_version"], gen),
        "rollout_ids": rollout_ids,
        "n_seqs": pa.array(acc.cat("n_seqs", np.int32)),
        "n_generated": pa.array(acc.cat("n_gen", np.int32)),
        "n_leaves": pa.array(acc.cat("n_leaves", np.int32)),
        "is_leaf": pa.array(acc.cat("is_leaf", bool)),
        "reward": pa.array(np.asarray(acc.leaf_rewards, dtype=np.float64), from_pandas=True),
        "branch_cause": pa.array(cause_names, pa.string()),
        "drift_call_id": _take_str(tbl["call_id"], drift_row),
    }
    return pa.table({f.name: cols[f.name].cast(f.type) for f in TREE_NODES}, schema=TREE_NODES)


def _sequence_rows(acc: _Acc, b: CallBatch, run_id: str, iteration: int) -> pa.Table:
    """One tree_sequences row per (tree, call x choice in it): the call's path ends at ``node_id``."""
    if not acc.seq_tree:
        return TREE_SEQUENCES.empty_table()
    tree = np.concatenate(acc.seq_tree)
    rows = np.concatenate(acc.seq_row)
    tbl = b.table
    idx = pa.array(rows)
    cols = {
        "run_id": pa.array(np.full(len(tree), run_id, dtype=object), pa.string()),
        "iteration": pa.array(np.full(len(tree), iteration, dtype=np.int32)),
        "tree_id": pa.array(acc.tree_ids, pa.string()).take(pa.array(tree)),
        "scope": pa.array(acc.scopes, pa.string()).take(pa.array(tree)),
        "call_id": pc.take(tbl["call_id"], idx),
        "choice_index": pc.fill_null(pc.take(tbl["choice_index"], idx), 0),
        "rollout_id": pc.take(tbl["rollout_id"], idx),
        "node_id": pa.array(np.concatenate(acc.seq_end).astype(np.int32)),
        "n_prompt": pa.array(b.prompt.length[rows].astype(np.int32)),
        "n_generated": pa.array(b.glen[rows].astype(np.int32)),
        "policy_version": pc.take(tbl["policy_version"], idx),
    }
    return pa.table({f.name: cols[f.name].cast(f.type) for f in TREE_SEQUENCES}, schema=TREE_SEQUENCES)
