"""Advantages on prefix trees (numpy, no torch).

- Outcome (GRPO, Shao et al. 2024, arXiv:2402.03300): a rollout's reward minus its group's mean (or the
  mean of the OTHER rollouts: RLOO, Ahmadian et al. 2024), optionally divided by the group std (off by
  default, Dr. GRPO, Liu et al. 2025, arXiv:2503.20783). Every token the rollout generated gets it.
- Tree (TreeRL, Hou et al. 2025, arXiv:2506.11902): a token's value V is the mean reward of the leaves below
  it (each leaf weighted by the rollouts that end there); global = V(token) - V(root), local = V(token) -
  V(parent branch point), where V(root) is the group's mean reward. Values are constant along an unbranched
  chain, so the result does not depend on how the trie was cut into radix nodes.
- GAE (Schulman et al. 2016, arXiv:1506.02438) along every root-to-leaf path over its generated tokens,
  the leaf's reward at the end; a token on several paths takes their mean weighted by rollouts per leaf.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TypeVar

import numpy as np

from clawpipe.train.data import RolloutInfo, TrainTree

EPS = 1e-6


# A GRPO group: ("group", group_id) or, for a rollout without a group, ("rollout", rollout_id); plus the
# harness with group_by "group_id+harness". Ids are free text, so the parts stay apart in a tuple: a groupless
# rollout named like a group, or a separator inside an id, cannot make two groups one.
GroupKey = tuple[str, ...]
K = TypeVar("K", bound=Hashable)


def group_key(info: RolloutInfo, group_by: str) -> GroupKey:
    """The rollout's GRPO group; a rollout without a group (None or empty group_id) is a group of its own."""
    base = ("group", info.group_id) if info.group_id else ("rollout", info.rollout_id)
    return (*base, info.harness) if group_by == "group_id+harness" else base


def group_moments(rewards: dict[str, float], keys: Mapping[str, K]) -> dict[K, tuple[float, float, int]]:
    """Per group key: (mean, sample std, count) of its rollouts' rewards."""
    by: dict[K, list[float]] = {}
    for rid, r in rewards.items():
        by.setdefault(keys[rid], []).append(r)
    return {k: (float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0, len(v)) for k, v in by.items()}


def outcome_advantages(
    rewards: dict[str, float], keys: Mapping[str, K], *, scale_std: bool, leave_one_out: bool
) -> dict[str, float]:
    """Group-relative outcome advantage per rollout id."""
    moments = group_moments(rewards, keys)
    out: dict[str, float] = {}
    for rid, r in rewards.items():
        mean, std, n = moments[keys[rid]]
        if n < 2:
            out[rid] = 0.0
            continue
        a = r - mean
        if leave_one_out:
            a *= n / (n - 1)  # r - mean(others)
        if scale_std:
            a /= std + EPS
        out[rid] = a
    return out


def leaf_table(tree: TrainTree, rewards: dict[str, float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per token: (number of children, reward sum over leaf rollouts below, leaf-rollout count below)."""
    n = tree.n_tokens
    nchild = np.bincount(tree.prev[tree.prev >= 0], minlength=n)
    ending: dict[int, set[str]] = {}
    for s in tree.sequences:
        last = int(s.positions[-1])
        if nchild[last] == 0:
            ending.setdefault(last, set()).add(s.rollout_id)
    total = np.zeros(n, dtype=np.float64)
    count = np.zeros(n, dtype=np.float64)
    for pos, rids in ending.items():
        total[pos] = sum(rewards[r] for r in rids)
        count[pos] = len(rids)
    prev = tree.prev.tolist()
    for i in range(n - 1, -1, -1):  # children come after parents
        p = prev[i]
        if p >= 0:
            total[p] += total[i]
            count[p] += count[i]
    return nchild, total, count


def tree_token_advantages(
    tree: TrainTree,
    rewards: dict[str, float],
    root_value: float,
    *,
    mode: str,
    leaf_norm: bool,
) -> np.ndarray:
    """TreeRL-style advantage of every token of the tree (before std scaling)."""
    nchild, total, count = leaf_table(tree, rewards)
    value = np.divide(total, count, out=np.full_like(total, root_value), where=count > 0)
    # value of the branch point each token hangs from (its parent node's value)
    parent_value = np.empty_like(value)
    prev = tree.prev.tolist()
    for i, p in enumerate(prev):
        if p < 0:
            parent_value[i] = root_value
        elif nchild[p] >= 2:
            parent_value[i] = value[p]
        else:
            parent_value[i] = parent_value[p]
    adv = np.zeros_like(value)
    if mode in ("tree_global", "tree_local_global"):
        adv += value - root_value
    if mode in ("tree_local", "tree_local_global"):
        adv += value - parent_value
    if leaf_norm:
        leaves = (nchild == 0).astype(np.float64)
        for i in range(tree.n_tokens - 1, -1, -1):
            if prev[i] >= 0:
                leaves[prev[i]] += leaves[i]
        adv /= np.sqrt(np.maximum(leaves, 1.0))
    return adv


def gae_token_advantages(
    tree: TrainTree,
    rewards: dict[str, float],
    values: np.ndarray,
    scored: np.ndarray,
    *,
    gamma: float,
    lam: float,
) -> np.ndarray:
    """GAE per token along every root-to-leaf path over the scored (trained) tokens.

    values: (N,) pre-step value estimates V(state before token); scored: (N,) bool. A token on several
    paths takes their mean weighted by the rollouts ending at each leaf. Unscored tokens get 0.
    """
    nchild, total, count = leaf_table(tree, rewards)
    adv_sum = np.zeros(tree.n_tokens, dtype=np.float64)
    w_sum = np.zeros(tree.n_tokens, dtype=np.float64)
    prev = tree.prev.tolist()
    for leaf in np.flatnonzero((nchild == 0) & (count > 0)).tolist():
        path = []
        i = leaf
        while i >= 0:
            if scored[i]:
                path.append(i)
            i = prev[i]
        if not path:
            continue
        path.reverse()  # root -> leaf
        reward = total[leaf] / count[leaf]
        w = count[leaf]
        v = values[path].astype(np.float64)
        a = 0.0
        for k in range(len(path) - 1, -1, -1):
            nxt = v[k + 1] if k + 1 < len(path) else 0.0
            r = reward if k == len(path) - 1 else 0.0
            delta = r + gamma * nxt - v[k]
            a = delta + gamma * lam * a
            adv_sum[path[k]] += w * a
            w_sum[path[k]] += w
    return np.divide(adv_sum, w_sum, out=np.zeros_like(adv_sum), where=w_sum > 0)
