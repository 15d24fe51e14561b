"""Training data: prefix trees laid out token by token, parent-first, with the call sequences mapped onto them.

A :class:`TrainTree` is a trie flattened to one row: ``token_ids[i]`` is a unique token, ``prev[i]`` the token
before it on every path through it (-1 for a first token) and ``depth[i]`` its position (tokens above it).
Parents come before children, so a slice of positions sorted ascending is again parent-first. Every
:class:`TrainSequence` (one call x choice: prompt + completion, CONTRACTS E) is a root-to-token path given
by its packed ``positions``; its completion tokens are the ones it trains. Rewards and groups live in
:class:`RolloutInfo`. Trees come from the lake (clawpipe.train.loading) or from :func:`build_tree` (tests,
benchmarks).
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
    """What training needs of a rollout: its outcome reward, GRPO group and harness."""

    rollout_id: str
    group_id: str
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
        """The tree restricted to the tokens the given sequences pass through, positions renumbered."""
        used = np.zeros(self.n_tokens, dtype=bool)
        for s in keep_sequences:
            used[s.positions] = True
        new_index = np.full(self.n_tokens, -1, dtype=np.int64)
        new_index[used] = np.arange(int(used.sum()))
        prev = self.prev[used]
        prev = np.where(prev >= 0, new_index[np.maximum(prev, 0)], -1)
        seqs = [
            TrainSequence(
                call_id=s.call_id,
                rollout_id=s.rollout_id,
                positions=new_index[s.positions],
                n_prompt=s.n_prompt,
                old_logprobs=s.old_logprobs,
                policy_version=s.policy_version,
                choice_index=s.choice_index,
            )
            for s in keep_sequences
        ]
        return TrainTree(self.tree_id, self.token_ids[used], prev, self.depth[used], seqs)


# ---------------------------------------------------------------------------------------------------------
# trees from node rows (the lake's tree_nodes) and from raw sequences (tests, benchmarks)


def tree_from_nodes(
    tree_id: str, node_ids: Sequence[int], parent_ids: Sequence[int], token_ids: Sequence[Sequence[int]]
) -> TrainTree:
    """Flatten radix nodes (node_id ascending is parent-first) to a token-level tree without sequences."""
    order = np.argsort(np.asarray(node_ids), kind="stable")
    last_of: dict[int, int] = {}  # node_id -> packed position of its last token (or its parent's, if empty)
    depth_of: dict[int, int] = {}  # node_id -> depth after its last token
    toks: list[int] = []
    prev: list[int] = []
    depth: list[int] = []
    for k in order.tolist():
        nid, pid = int(node_ids[k]), int(parent_ids[k]) if parent_ids[k] is not None else -1
        if pid >= 0 and pid not in last_of:
            raise TrainingError(
                f"tree {tree_id}: node {nid} comes before its parent {pid}; tree_nodes must be parent-first "
                "(rebuild the trees with `clawpipe trees build`)"
            )
        p_last = last_of[pid] if pid >= 0 else -1
        d = depth_of[pid] if pid >= 0 else 0
        for t in token_ids[k] or ():
            prev.append(p_last)
            depth.append(d)
            toks.append(int(t))
            p_last = len(toks) - 1
            d += 1
        last_of[nid] = p_last
        depth_of[nid] = d
    return TrainTree(
        tree_id,
        np.asarray(toks, dtype=np.int64),
        np.asarray(prev, dtype=np.int64),
        np.asarray(depth, dtype=np.int64),
    )


def locate_sequence(tree: TrainTree, kids: list[list[int]], tokens: np.ndarray) -> np.ndarray | None:
    """Packed positions of ``tokens`` as a root-to-token path of the tree, or None when it is not one.

    Tries every matching child (a trie may hold a generated and a context copy of the same token after the
    same prefix), depth first.
    """
    n = len(tokens)
    if n == 0:
        return None
    tok = tree.token_ids
    path = np.empty(n, dtype=np.int64)
    # stack of (index in tokens, candidate children iterator)
    stack: list[tuple[int, list[int], int]] = [(0, kids[tree.n_tokens], 0)]
    while stack:
        i, cands, k = stack.pop()
        while k < len(cands) and tok[cands[k]] != tokens[i]:
            k += 1
        if k == len(cands):
            continue
        stack.append((i, cands, k + 1))  # alternatives to try if this branch fails
        pos = cands[k]
        path[i] = pos
        # follow single-child chains without pushing
        i += 1
        while i < n:
            ch = kids[pos]
            if len(ch) == 1:
                if tok[ch[0]] != tokens[i]:
                    break
                pos = ch[0]
                path[i] = pos
                i += 1
            else:
                stack.append((i, ch, 0))
                break
        if i == n:
            return path
    return None


def build_tree(tree_id: str, sequences: Iterable[dict]) -> TrainTree:
    """Build a trie directly from sequences (for tests and benchmarks, no lake needed).

    Each dict has ``tokens`` (prompt + completion ids), ``n_prompt``, ``rollout_id``, optional ``call_id``,
    ``old_logprobs`` (default zeros) and ``policy_version``. Tokens are laid out depth-first, parent-first.
    """
    seqs = list(sequences)
    child: list[dict[int, int]] = [{}]  # trie over tokens; node 0 is the root
    tok_of: list[int] = [-1]
    parent: list[int] = [-1]
    node_paths: list[list[int]] = []
    for s in seqs:
        cur, path = 0, []
        for t in s["tokens"]:
            t = int(t)
            nxt = child[cur].get(t)
            if nxt is None:
                nxt = len(tok_of)
                child[cur][t] = nxt
                child.append({})
                tok_of.append(t)
                parent.append(cur)
            path.append(nxt)
            cur = nxt
        node_paths.append(path)
    # depth-first layout
    order: list[int] = []
    stack = list(reversed(child[0].values()))
    while stack:
        v = stack.pop()
        order.append(v)
        stack.extend(reversed(child[v].values()))
    pos_of = np.zeros(len(tok_of), dtype=np.int64)
    pos_of[order] = np.arange(len(order))
    token_ids = np.asarray([tok_of[v] for v in order], dtype=np.int64)
    prev = np.asarray([pos_of[parent[v]] if parent[v] > 0 else -1 for v in order], dtype=np.int64)
    depth = np.zeros(len(order), dtype=np.int64)
    for i, p in enumerate(prev.tolist()):
        depth[i] = depth[p] + 1 if p >= 0 else 0
    tree = TrainTree(tree_id, token_ids, prev, depth)
    for k, (s, path) in enumerate(zip(seqs, node_paths, strict=True)):
        n_gen = len(s["tokens"]) - int(s["n_prompt"])
        lps = s.get("old_logprobs")
        tree.sequences.append(
            TrainSequence(
                call_id=str(s.get("call_id", f"{tree_id}-c{k}")),
                rollout_id=str(s["rollout_id"]),
                positions=pos_of[np.asarray(path, dtype=np.int64)],
                n_prompt=int(s["n_prompt"]),
                old_logprobs=np.asarray(lps if lps is not None else np.zeros(n_gen), dtype=np.float32),
                policy_version=s.get("policy_version"),
                choice_index=int(s.get("choice_index", 0)),
            )
        )
    return tree
