"""Packing trees into micro-batches around a token target, and the flat baseline layout.

Tree layout: each micro-batch is ONE row holding several trees (or pieces of a tree) back to back,
parent-first and depth-first (each branch contiguous); position_ids = depth. No padding is needed, so no
padding position ever attends or is attended. Attention over the row follows the tree
(clawpipe.train.attention): causal kernels on its chains, each branch seeing its ancestors' keys, in memory
linear in the row's length; ``attention = "dense"`` instead passes one [1, 1, n, n] ancestor mask (row i
allows exactly i's ancestors and i itself) through the model's own attention, n^2 bytes, as a reference.

``max_tokens_per_micro_batch`` is a packing target, not a limit. Trees are bin-packed into rows of at most
the target; a tree larger than the target is cut into pieces that each own a set of tokens (their loss
contributions live there) and repeat, as plain context, the ancestors they need, so every owned token sees
exactly its own prefix, as in the flat computation. A tree whose longest path L is longer than the target
is cut into pieces of up to L + target tokens instead (the path, plus up to a target's worth of branches
sharing its context, which would otherwise repeat that context), and such a piece goes into a micro-batch
of its own: a path is never an error, and a micro-batch above the target holds one piece of one tree whose
longest path is above the target.
Why a micro-batch of its own rather than chunks that carry the context's keys and values: the whole path
then runs through the model's ordinary forward and backward (gradients reach the context through
attention as usual, with nothing held across separate backward passes), the loss stays exactly the flat
one, and with linear-memory attention (and optional activation checkpointing) a long path costs memory
in proportion to its length.

Flat layout (the baseline): one row per sequence, right-padded, ordinary causal attention; rows are
grouped so that rows x longest <= the target, and a longer sequence is a group of its own.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch

from clawpipe.train.attention import TreeAttention, build_plan, dense_mask
from clawpipe.train.batch import TrainBatch
from clawpipe.train.data import TrainTree


@dataclass
class MicroBatch:
    """One forward pass: model inputs, the positions to score, and the contributions they feed."""

    input_ids: torch.Tensor  # (B, L) int64
    position_ids: torch.Tensor  # (B, L) int64
    attention_mask: torch.Tensor | None  # (B, L) int64 for flat rows; (1, 1, L, L) bool for dense tree rows
    score_rows: torch.Tensor  # (S,) int64 flat index into B*L of the hidden state predicting each scored token
    score_targets: torch.Tensor  # (S,) int64 the scored token ids
    contrib_index: np.ndarray  # (C_mb,) indices into TrainBatch.contrib
    contrib_score: torch.Tensor  # (C_mb,) int64 index of each contribution's scored token
    n_tokens: int  # real (non-padding) tokens in the forward
    tree: TreeAttention | None = None  # tree rows with attention = "blocks" (no mask tensor then)

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.attention_mask.to(device) if self.attention_mask is not None else None,
            self.score_rows.to(device),
            self.score_targets.to(device),
            self.contrib_index,
            self.contrib_score.to(device),
            self.n_tokens,
            self.tree,
        )


def longest_path(tree: TrainTree) -> int:
    """Tokens on the tree's longest root-to-token path."""
    return int(tree.depth.max()) + 1 if tree.n_tokens else 0


def piece_capacity(tree: TrainTree, budget: int) -> int:
    """Tokens one piece of the tree may hold: the budget, or longest path + budget when a path exceeds it."""
    longest = longest_path(tree)
    return budget if longest <= budget else longest + budget


def split_tree(tree: TrainTree, owned: np.ndarray, budget: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Cut a tree into pieces of <= piece_capacity tokens: [(positions depth-first, owned positions)].

    Tokens are taken depth first; a piece that cannot take a token's missing ancestors plus the token is
    closed and a new one starts with the token's full ancestor chain (context only). The capacity is at
    least the longest path, so that chain always fits.
    """
    order = dfs_order(tree)
    budget = piece_capacity(tree, budget)
    if tree.n_tokens <= budget:
        return [(order, owned)]
    rank = np.empty(tree.n_tokens, dtype=np.int64)
    rank[order] = np.arange(tree.n_tokens)
    prev = tree.prev.tolist()
    is_owned = np.zeros(tree.n_tokens, dtype=bool)
    is_owned[owned] = True
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    members: set[int] = set()
    for v in order.tolist():
        missing = []
        p = prev[v]
        while p >= 0 and p not in members:
            missing.append(p)
            p = prev[p]
        if len(members) + len(missing) + 1 > budget:
            pieces.append(_piece(members, is_owned, rank))
            members = set()
            missing = []
            p = prev[v]
            while p >= 0:
                missing.append(p)
                p = prev[p]
        members.update(missing)
        members.add(v)
    if members:
        pieces.append(_piece(members, is_owned, rank))
    # a token belongs to (is owned by) the first piece that holds it as a non-context member
    seen = np.zeros(tree.n_tokens, dtype=bool)
    out = []
    for positions, own in pieces:
        own = own[~seen[own]]
        seen[own] = True
        out.append((positions, own))
    return out


def _piece(members: set[int], is_owned: np.ndarray, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    positions = np.asarray(sorted(members, key=rank.__getitem__), dtype=np.int64)  # depth-first, parent-first
    return positions, positions[is_owned[positions]]


def dfs_order(tree: TrainTree) -> np.ndarray:
    """Positions in depth-first order (parent-first, each branch contiguous: good blocks for tree attention)."""
    kids = tree.children()
    order: list[int] = []
    stack = list(reversed(kids[tree.n_tokens]))
    while stack:
        v = stack.pop()
        order.append(v)
        stack.extend(reversed(kids[v]))
    return np.asarray(order, dtype=np.int64)


def pack_trees(
    batch: TrainBatch,
    budget: int,
    *,
    attention: str = "blocks",
    block: int = 128,
    trees: Collection[int] | None = None,
) -> list[MicroBatch]:
    """Tree layout: pieces bin-packed (first fit decreasing) into one-row micro-batches of <= budget tokens;
    a piece longer than the budget (a long path) is a micro-batch of its own. ``trees``: pack only these
    tree indices (a rank's share in distributed training); contribution indices stay the batch's."""
    c = batch.contrib
    wanted = None if trees is None else set(trees)
    # each tree's contributions (ascending), found once: scanning c.tree per tree and per piece made packing
    # grow with trees x contributions (thousands of small rollout trees)
    by_tree = np.argsort(c.tree, kind="stable")
    bounds = np.searchsorted(c.tree[by_tree], np.arange(len(batch.trees) + 1))
    pieces: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []  # (tree, positions, owned, contributions)
    for ti, tree in enumerate(batch.trees):
        if wanted is not None and ti not in wanted:
            continue
        sel = by_tree[bounds[ti] : bounds[ti + 1]]
        for positions, own in split_tree(tree, np.unique(c.pos[sel]), budget):
            if len(own):
                pieces.append((ti, positions, own, sel))
    pieces.sort(key=lambda p: -len(p[1]))
    bins: list[list[int]] = []
    sizes: list[int] = []
    open_bins: list[int] = []  # bins that may still take a piece, in creation order (first fit)
    for k, (_, positions, _, _) in enumerate(pieces):
        for b in open_bins:
            if sizes[b] + len(positions) <= budget:
                bins[b].append(k)
                sizes[b] += len(positions)
                break
        else:
            bins.append([k])
            sizes.append(len(positions))
            open_bins.append(len(bins) - 1)
        # pieces come largest first: a bin without room for this one's successor is full for good
        smallest = len(pieces[k + 1][1]) if k + 1 < len(pieces) else 0
        open_bins = [b for b in open_bins if sizes[b] + smallest <= budget]
    return [_tree_micro_batch(batch, [pieces[k] for k in b], attention, block) for b in bins]


def _index_in(values: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Index in ``values`` (distinct) of each element of ``query``, -1 where absent; O((n + q) log n)."""
    if not len(values):
        return np.full(len(query), -1, dtype=np.int64)
    srt = np.argsort(values, kind="stable")
    at = np.minimum(np.searchsorted(values[srt], query), len(values) - 1)
    hit = values[srt[at]] == query
    return np.where(hit, srt[at], -1)


def _tree_micro_batch(
    batch: TrainBatch, pieces: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]], attention: str, block: int
) -> MicroBatch:
    c = batch.contrib
    n = sum(len(p[1]) for p in pieces)
    ids = np.empty(n, dtype=np.int64)
    pos_ids = np.empty(n, dtype=np.int64)
    parent = np.empty(n, dtype=np.int64)  # row of each token's parent in this row, -1 for a root
    rows, targets, contrib_index, contrib_score = [], [], [], []
    offset = 0
    n_scored = 0
    for ti, positions, own, tree_sel in pieces:
        tree = batch.trees[ti]
        m = len(positions)
        # piece-local lookups by search, not arrays the size of the tree: a tree cut into many pieces
        # would otherwise cost pieces x tree size
        ids[offset : offset + m] = tree.token_ids[positions]
        pos_ids[offset : offset + m] = tree.depth[positions]
        lprev = tree.prev[positions]
        parent[offset : offset + m] = np.where(lprev >= 0, offset + _index_in(positions, lprev), -1)
        # scored tokens: owned positions; their hidden state is the parent's
        rows.append(offset + _index_in(positions, tree.prev[own]))
        targets.append(tree.token_ids[own])
        k_own = _index_in(own, c.pos[tree_sel])
        sel = tree_sel[k_own >= 0]
        contrib_index.append(sel)
        contrib_score.append(n_scored + k_own[k_own >= 0])
        n_scored += len(own)
        offset += m
    dense = attention == "dense"
    return MicroBatch(
        input_ids=torch.from_numpy(ids)[None],
        position_ids=torch.from_numpy(pos_ids)[None],
        attention_mask=torch.from_numpy(dense_mask(parent))[None, None] if dense else None,
        score_rows=torch.from_numpy(np.concatenate(rows)),
        score_targets=torch.from_numpy(np.concatenate(targets)),
        contrib_index=np.concatenate(contrib_index),
        contrib_score=torch.from_numpy(np.concatenate(contrib_score)),
        n_tokens=n,
        tree=None if dense else build_plan(parent, block),
    )


def pack_flat(batch: TrainBatch, budget: int, pad_id: int = 0) -> list[MicroBatch]:
    """Flat layout: one right-padded row per sequence, rows grouped so that rows x longest <= budget (a
    longer sequence is a group of its own)."""
    c = batch.contrib
    lengths = np.asarray([len(s.positions) for _, s in batch.sequences])
    order = np.argsort(-lengths, kind="stable").tolist()
    by_seq = np.argsort(c.seq, kind="stable")
    starts = np.searchsorted(c.seq[by_seq], np.arange(len(batch.sequences) + 1))
    groups: list[list[int]] = []
    for k in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(k)
        else:
            groups.append([k])
    out = []
    for g in groups:
        width = int(lengths[g[0]])
        ids = np.full((len(g), width), pad_id, dtype=np.int64)
        att = np.zeros((len(g), width), dtype=np.int64)
        rows, targets, cidx = [], [], []
        for b, k in enumerate(g):
            ti, s = batch.sequences[k]
            toks = batch.trees[ti].token_ids[s.positions]
            ids[b, : len(toks)] = toks
            att[b, : len(toks)] = 1
            sel = by_seq[starts[k] : starts[k + 1]]
            k_in = c.idx[sel]
            rows.append(b * width + k_in - 1)
            targets.append(toks[k_in])
            cidx.append(sel)
        contrib_index = np.concatenate(cidx)
        out.append(
            MicroBatch(
                input_ids=torch.from_numpy(ids),
                position_ids=torch.arange(width).expand(len(g), width).contiguous(),
                attention_mask=torch.from_numpy(att),
                score_rows=torch.from_numpy(np.concatenate(rows)),
                score_targets=torch.from_numpy(np.concatenate(targets)),
                contrib_index=contrib_index,
                contrib_score=torch.arange(len(contrib_index)),
                n_tokens=int(att.sum()),
            )
        )
    return out
