"""Training data: prefix trees laid out token by token, parent-first, with the call sequences mapped onto them.

A :class:`TrainTree` is a trie flattened to one row: ``token_ids[i]`` is a unique token, ``prev[i]`` the token
before it on every path through it (-1 for a first token) and ``depth[i]`` its position (tokens above it).
Parents come before children, so a slice of positions sorted ascending is again parent-first. Every
:class:`TrainSequence` (one call x choice: prompt + completion) is a root-to-token path given by its packed
``positions``; its completion tokens are the ones it trains. Rewards and groups live in :class:`RolloutInfo`.

Trees come from the trees room's tables: :func:`flatten_nodes` lays out the radix nodes (tree_nodes) and
:func:`attach_sequences` places each call where the trees room linked it (tree_sequences: the node where
its path ends), so training never searches a tree for a call. clawpipe.train.loading reads both from the
lake.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from clawpipe.errors import TrainingError

log = logging.getLogger(__name__)


@dataclass
class RolloutInfo:
    """What training needs of a rollout: its outcome reward, GRPO group and harness.

    ``group_id`` is the rollout's own (None without one: it is then a group of its own, never the group
    whose id equals its rollout id; clawpipe.train.advantages.group_key)."""

    rollout_id: str
    group_id: str | None
    harness: str
    reward: float


@dataclass
class TrainSequence:
    """One call x choice: a root-to-token path of its tree; tokens from ``n_prompt`` on are generated."""

    call_id: str
    rollout_id: str
    positions: np.ndarray  # (L,) int64 packed positions of the sequence's tokens in its tree
    n_prompt: int
    old_logprobs: np.ndarray  # (L - n_prompt,) float32 sampling logprobs captured with the call
    policy_version: int | None = None
    choice_index: int = 0

    @property
    def gen_positions(self) -> np.ndarray:
        return self.positions[self.n_prompt :]


@dataclass
class TrainTree:
    """A prefix tree flattened parent-first, with the sequences that pass through it."""

    tree_id: str
    token_ids: np.ndarray  # (N,) int64
    prev: np.ndarray  # (N,) int64, -1 for a first token
    depth: np.ndarray  # (N,) int64 = position id
    sequences: list[TrainSequence] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def flattened_tokens(self) -> int:
        return int(sum(len(s.positions) for s in self.sequences))

    def children(self) -> list[list[int]]:
        """Child positions of every position, plus the roots' list at index N."""
        kids: list[list[int]] = [[] for _ in range(self.n_tokens + 1)]
        for i, p in enumerate(self.prev.tolist()):
            kids[p if p >= 0 else self.n_tokens].append(i)
        return kids

    def pruned(self, keep_sequences: Sequence[TrainSequence]) -> TrainTree:
        """The tree restricted to the tokens the given sequences pass through, positions renumbered.

        Paths that share an array (views of one buffer: :meth:`NodeLayout.paths`) still share one after, and
        when every token is kept they are kept as they are: renumbering each call's path on its own held every
        call's whole history again."""
        paths = [s.positions for s in keep_sequences]
        used = np.zeros(self.n_tokens, dtype=bool)
        _mark(used, paths)
        if used.all():
            tree = TrainTree(self.tree_id, self.token_ids, self.prev, self.depth)
        else:
            new_index = np.full(self.n_tokens, -1, dtype=np.int64)
            new_index[used] = np.arange(int(used.sum()))
            prev = self.prev[used]
            prev = np.where(prev >= 0, new_index[np.maximum(prev, 0)], -1)
            paths = _renumbered(paths, new_index)
            tree = TrainTree(self.tree_id, self.token_ids[used], prev, self.depth[used])
        tree.sequences = [
            TrainSequence(
                call_id=s.call_id,
                rollout_id=s.rollout_id,
                positions=path,
                n_prompt=s.n_prompt,
                old_logprobs=s.old_logprobs,
                policy_version=s.policy_version,
                choice_index=s.choice_index,
            )
            for s, path in zip(keep_sequences, paths, strict=True)
        ]
        return tree


def _runs_of(paths: list[np.ndarray]) -> tuple[dict[int, tuple[np.ndarray, list[tuple[int, int]]]], list[int]]:
    """The paths that are runs of one array, grouped by that array: id(base) -> (base, [(start, end)]), and per
    path its start in its base (-1 for a path of its own)."""
    runs: dict[int, tuple[np.ndarray, list[tuple[int, int]]]] = {}
    starts: list[int] = []
    for p in paths:
        base = p.base
        if not (isinstance(base, np.ndarray) and _is_slice_of(p, base)):
            starts.append(-1)
            continue
        at = (p.ctypes.data - base.ctypes.data) // base.itemsize
        starts.append(at)
        runs.setdefault(id(base), (base, []))[1].append((at, at + len(p)))
    return runs, starts


def _mark(used: np.ndarray, paths: list[np.ndarray]) -> None:
    """Set ``used`` at every position of the paths; paths sharing an array are marked as the union of their
    runs, so the calls of one lineage mark its tokens once, not each call's whole history again."""
    runs, starts = _runs_of(paths)
    for p, at in zip(paths, starts, strict=True):
        if at < 0:
            used[p] = True
    for base, spans in runs.values():
        spans.sort()
        lo, hi = spans[0]
        for a, b in spans[1:]:
            if a > hi:
                used[base[lo:hi]] = True
                lo = a
            hi = max(hi, b)
        used[base[lo:hi]] = True


def _renumbered(paths: list[np.ndarray], new_index: np.ndarray) -> list[np.ndarray]:
    """Each path through ``new_index``; paths that are runs of one array are renumbered together, once, and
    come back as read-only views of one array again."""
    runs, starts = _runs_of(paths)
    done = {}
    for k, (base, spans) in runs.items():
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        # between runs a base may hold ids no path uses (a buffer's spare room): clipped, never handed out
        done[k] = (lo, new_index.take(base[lo:hi], mode="clip"))
    out = []
    for p, at in zip(paths, starts, strict=True):
        if at < 0:
            out.append(new_index[p])
            continue
        lo, renumbered = done[id(p.base)]
        view = renumbered[at - lo : at - lo + len(p)]
        view.flags.writeable = False
        out.append(view)
    return out


def _is_slice_of(view: np.ndarray, base: np.ndarray) -> bool:
    """Whether ``view`` is a contiguous 1-D run of the 1-D array ``base`` (same dtype)."""
    if view.ndim != 1 or base.ndim != 1 or view.dtype != base.dtype or view.strides != base.strides:
        return False
    at = view.ctypes.data - base.ctypes.data
    return at % base.itemsize == 0 and 0 <= at // base.itemsize <= len(base) - len(view)


# ---------------------------------------------------------------------------------------------------------
# trees from node rows (the lake's tree_nodes) and from raw sequences (tests, benchmarks)


@dataclass
class NodeLayout:
    """Where each radix node's tokens lie in its flattened tree: first packed position, token count, parent."""

    first: dict[int, int]
    count: dict[int, int]
    parent: dict[int, int]  # -1 for children of the (empty) root

    def paths(self, node_ids: Iterable[int]) -> dict[int, np.ndarray]:
        """Packed positions of the root-to-node path of each known node in ``node_ids`` (unknown ones left out).

        One walk down the tree writes each node's positions at its depths into a buffer, and a path is a
        read-only view of the buffer's head when the walk reaches its node: calls that extend one another (a
        harness's turns) share one array, so the paths hold about the unique tokens plus one copy of the prefix
        per branch, not every call's whole history, and cost one visit per node. (Walking up from each call's
        node to the root cost calls x nodes on the path: a rollout of n turns is a chain of about n nodes.)"""
        wanted = {v for v in node_ids if v in self.first}
        out: dict[int, np.ndarray] = {}
        if not wanted:
            return out
        kids: dict[int, list[int]] = {}
        for v, p in self.parent.items():
            kids.setdefault(p, []).append(v)
        height = self._heights(kids)
        buf = np.empty(max((height[v] for v in kids.get(-1, ())), default=0), dtype=np.int64)
        shared = 0  # the head of buf that views handed out hold: a branch written below it needs a new buffer
        stack = [(v, 0) for v in kids.get(-1, ())]
        while stack:
            v, d = stack.pop()
            if d < shared or d + height[v] > len(buf):  # a later branch (or a taller one): its own buffer, with
                # the prefix it shares copied once
                fresh = np.empty(d + height[v], dtype=np.int64)
                fresh[:d] = buf[:d]
                buf, shared = fresh, 0
            first, n = self.first[v], self.count[v]
            buf[d : d + n] = np.arange(first, first + n)
            if v in wanted:
                path = buf[: d + n]
                path.flags.writeable = False
                out[v] = path
                shared = d + n
            stack.extend((c, d + n) for c in kids.get(v, ()))
        return out

    def _heights(self, kids: dict[int, list[int]]) -> dict[int, int]:
        """Tokens on the longest downward path from each node's first token (its own count included)."""
        order: list[int] = []
        todo = list(kids.get(-1, ()))
        while todo:
            v = todo.pop()
            order.append(v)
            todo.extend(kids.get(v, ()))
        height: dict[int, int] = {}
        for v in reversed(order):  # children before parents
            height[v] = self.count[v] + max((height[c] for c in kids.get(v, ())), default=0)
        return height


def flatten_nodes(
    tree_id: str, node_ids: Sequence[int], parent_ids: Sequence[int | None], token_ids: Sequence[Sequence[int] | None]
) -> tuple[TrainTree, NodeLayout]:
    """Flatten radix nodes (node_id ascending is parent-first) to a token-level tree without sequences.

    Each node's tokens take consecutive positions, nodes in node_id order, so a path is a few ranges.
    """
    order = np.argsort(np.asarray(node_ids), kind="stable").tolist()
    lists = [token_ids[k] for k in order]
    counts = [len(t) if t is not None else 0 for t in lists]
    firsts = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(counts, out=firsts[1:])
    last_of: dict[int, int] = {}  # node_id -> packed position of its last token (or its parent's, if empty)
    depth_of: dict[int, int] = {}  # node_id -> depth after its last token
    layout = NodeLayout({}, {}, {})
    node_prev = np.empty(len(order), dtype=np.int64)  # the packed position before each node's first token
    node_depth = np.empty(len(order), dtype=np.int64)  # the depth of each node's first token
    for i, k in enumerate(order):
        pk = parent_ids[k]
        nid, pid = int(node_ids[k]), int(pk) if pk is not None else -1
        if pid >= 0 and pid not in last_of:
            raise TrainingError(
                f"tree {tree_id}: node {nid} comes before its parent {pid}; tree_nodes must be parent-first "
                "(rebuild the trees with `clawpipe trees build`)"
            )
        p_last = last_of[pid] if pid >= 0 else -1
        d = depth_of[pid] if pid >= 0 else 0
        first, n = int(firsts[i]), counts[i]
        layout.first[nid], layout.parent[nid], layout.count[nid] = first, pid, n
        node_prev[i], node_depth[i] = p_last, d
        last_of[nid] = first + n - 1 if n else p_last
        depth_of[nid] = d + n
    # the tokens themselves, vectorised per node: each token's parent is the one before it, but a node's
    # first token hangs under its parent node's last
    total = int(firsts[-1])
    pieces = [np.asarray(t, dtype=np.int64) for t, n in zip(lists, counts, strict=True) if n]
    toks = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    n_per = np.asarray(counts, dtype=np.int64)
    prev = np.arange(total, dtype=np.int64) - 1
    prev[firsts[:-1][n_per > 0]] = node_prev[n_per > 0]
    depth = np.arange(total, dtype=np.int64) - np.repeat(firsts[:-1] - node_depth, n_per)
    return TrainTree(tree_id, toks, prev, depth), layout


def tree_from_nodes(
    tree_id: str, node_ids: Sequence[int], parent_ids: Sequence[int | None], token_ids: Sequence[Sequence[int] | None]
) -> TrainTree:
    """:func:`flatten_nodes` without the layout."""
    return flatten_nodes(tree_id, node_ids, parent_ids, token_ids)[0]


def attach_sequences(tree: TrainTree, layout: NodeLayout, links: Iterable[dict], stats: dict[str, float]) -> None:
    """Add each linked call x choice to ``tree`` as the path ending at its node, in the given order.

    A link (a row of ``sql/train/sequences.sql``) has call_id, choice_index, rollout_id, policy_version,
    node_id, n_prompt, n_completion and completion_logprobs. A link whose path does not hold exactly its
    prompt and completion (trees rebuilt from other calls since) is counted as ``calls_link_mismatch`` and
    left out, never trained on other tokens.
    """
    links = list(links)
    paths = layout.paths(int(c["node_id"]) for c in links)
    for c in links:
        n_prompt, n_completion = int(c["n_prompt"] or 0), int(c["n_completion"] or 0)
        positions = paths.get(int(c["node_id"]))
        if positions is None or len(positions) != n_prompt + n_completion:
            stats["calls_link_mismatch"] = stats.get("calls_link_mismatch", 0) + 1
            log.warning(
                "call %s/%s does not fit its tree_sequences link in %s; rebuild the trees (`clawpipe trees build`)",
                c["call_id"],
                c["choice_index"],
                tree.tree_id,
            )
            continue
        stats["calls"] = stats.get("calls", 0) + 1
        tree.sequences.append(
            TrainSequence(
                call_id=c["call_id"],
                rollout_id=c["rollout_id"],
                positions=positions,
                n_prompt=n_prompt,
                old_logprobs=np.asarray(c["completion_logprobs"], dtype=np.float32),
                policy_version=c["policy_version"],
                choice_index=int(c["choice_index"] or 0),
            )
        )
