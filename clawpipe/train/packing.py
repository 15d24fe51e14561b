"""Packing trees into micro-batches of at most ``budget`` tokens, and the flat baseline layout.

Attention over a packed row is block-sparse by default (clawpipe.train.attention: query blocks attend only
to their ancestors' keys); the dense 4D mask is the fallback (``attention = "dense"``).

Tree layout: each micro-batch is ONE row holding several trees (or pieces of a tree) back to back,
parent-first; position_ids = depth; a 4D mask [1, 1, n, n] where row i allows exactly i's ancestors and
i itself (block-diagonal across trees). No padding is needed, so no padding position ever attends or is
attended. A tree larger than the budget is cut into pieces: each piece owns a set of tokens (their loss
contributions live there) and repeats, as plain context, the ancestors it needs; every owned token thus
sees exactly its own prefix, as in the flat computation. A dense bool mask costs n^2 bytes (16 MB at the
default 4096 tokens): the budget bounds it.

Flat layout (the baseline): one row per sequence, right-padded, ordinary causal attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from clawpipe.errors import TrainingError
from clawpipe.train.attention import TreeBlocks, build_blocks
from clawpipe.train.batch import TrainBatch
from clawpipe.train.data import TrainTree


@dataclass
class MicroBatch:
    """One forward pass: model inputs, the positions to score, and the contributions they feed."""

    input_ids: torch.Tensor  # (B, L) int64
    position_ids: torch.Tensor  # (B, L) int64
    attention_mask: torch.Tensor  # (1, 1, L, L) bool for tree rows; (B, L) int64 for flat rows
    score_rows: torch.Tensor  # (S,) int64 flat index into B*L of the hidden state predicting each scored token
    score_targets: torch.Tensor  # (S,) int64 the scored token ids
    contrib_index: np.ndarray  # (C_mb,) indices into TrainBatch.contrib
    contrib_score: torch.Tensor  # (C_mb,) int64 index of each contribution's scored token
    n_tokens: int  # real (non-padding) tokens in the forward
    blocks: TreeBlocks | None = None  # block-sparse tree attention (tree rows, attention = "blocks")

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.attention_mask.to(device),
            self.score_rows.to(device),
            self.score_targets.to(device),
            self.contrib_index,
            self.contrib_score.to(device),
            self.n_tokens,
            self.blocks.to(device) if self.blocks is not None else None,
        )


def split_tree(tree: TrainTree, owned: np.ndarray, budget: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Cut a tree into pieces of <= budget tokens: [(positions depth-first, owned scored positions)].

    Tokens are taken depth first; a piece that cannot take a token's missing ancestors plus the token is
    closed and a new one starts with the token's full ancestor chain (context only).
    """
    order = dfs_order(tree)
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
            if len(missing) + 1 > budget:
                raise TrainingError(
                    f"tree {tree.tree_id}: a path of {len(missing) + 1} tokens exceeds max_tokens_per_micro_batch "
                    f"= {budget}; raise the budget above the longest sequence"
                )
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


def pack_trees(batch: TrainBatch, budget: int, block: int | None = None) -> list[MicroBatch]:
    """Tree layout: pieces bin-packed (first fit decreasing) into one-row micro-batches of <= budget tokens."""
    c = batch.contrib
    pieces: list[tuple[int, np.ndarray, np.ndarray]] = []  # (tree, positions, owned)
    for ti, tree in enumerate(batch.trees):
        owned = np.unique(c.pos[c.tree == ti])
        for positions, own in split_tree(tree, owned, budget):
            if len(own):
                pieces.append((ti, positions, own))
    pieces.sort(key=lambda p: -len(p[1]))
    bins: list[list[int]] = []
    sizes: list[int] = []
    for k, (_, positions, _) in enumerate(pieces):
        for b in range(len(bins)):
            if sizes[b] + len(positions) <= budget:
                bins[b].append(k)
                sizes[b] += len(positions)
                break
        else:
            bins.append([k])
            sizes.append(len(positions))
    return [_tree_micro_batch(batch, [pieces[k] for k in b], block) for b in bins]


def _tree_micro_batch(
    batch: TrainBatch, pieces: list[tuple[int, np.ndarray, np.ndarray]], block: int | None
) -> MicroBatch:
    c = batch.contrib
    n = sum(len(p[1]) for p in pieces)
    ids = np.empty(n, dtype=np.int64)
    pos_ids = np.empty(n, dtype=np.int64)
    allowed = np.zeros((n, n), dtype=bool)
    rows, targets, contrib_index, contrib_score = [], [], [], []
    offset = 0
    n_scored = 0
    for ti, positions, own in pieces:
        tree = batch.trees[ti]
        m = len(positions)
        local = np.full(tree.n_tokens, -1, dtype=np.int64)
        local[positions] = np.arange(m)
        ids[offset : offset + m] = tree.token_ids[positions]
        pos_ids[offset : offset + m] = tree.depth[positions]
        lprev = tree.prev[positions]
        lprev = np.where(lprev >= 0, local[np.maximum(lprev, 0)], -1).tolist()
        sub = allowed[offset : offset + m, offset : offset + m]
        for i, p in enumerate(lprev):  # row i = row of its parent + itself (parents come first)
            if p >= 0:
                sub[i] = sub[p]
            sub[i, i] = True
        # scored tokens: owned positions; their hidden state is the parent's
        rows.append(offset + local[tree.prev[own]])
        targets.append(tree.token_ids[own])
        sel = np.flatnonzero(c.tree == ti)
        sel = sel[np.isin(c.pos[sel], own)]
        score_of = np.full(tree.n_tokens, -1, dtype=np.int64)
        score_of[own] = n_scored + np.arange(len(own))
        n_scored += len(own)
        contrib_index.append(sel)
        contrib_score.append(score_of[c.pos[sel]])
        offset += m
    return MicroBatch(
        input_ids=torch.from_numpy(ids)[None],
        position_ids=torch.from_numpy(pos_ids)[None],
        attention_mask=torch.from_numpy(allowed)[None, None],
        score_rows=torch.from_numpy(np.concatenate(rows)),
        score_targets=torch.from_numpy(np.concatenate(targets)),
        contrib_index=np.concatenate(contrib_index),
        contrib_score=torch.from_numpy(np.concatenate(contrib_score)),
        n_tokens=n,
        blocks=build_blocks(allowed, block) if block else None,
    )


def pack_flat(batch: TrainBatch, budget: int, pad_id: int = 0) -> list[MicroBatch]:
    """Flat layout: one right-padded row per sequence, rows grouped so that rows x longest <= budget."""
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
            if lengths[k] > budget:
                raise TrainingError(
                    f"a sequence of {lengths[k]} tokens exceeds max_tokens_per_micro_batch = {budget}; raise it"
                )
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
