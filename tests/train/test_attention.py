"""Tree attention over packed rows: equal to a dense ancestor mask, without an n x n mask or score matrix."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from clawpipe.train.attention import build_plan, dense_mask, tree_attention_forward
from clawpipe.train.batch import build_batch
from clawpipe.train.config import make_config
from clawpipe.train.data import RolloutInfo
from clawpipe.train.packing import pack_trees
from tests.trees.training import build_tree


def random_parents(rng: np.random.Generator, n: int, roots: int, depth_first: bool) -> np.ndarray:
    """Parent rows of a parent-first row holding ``roots`` trees; depth-first layouts keep chains contiguous."""
    parent = np.full(n, -1, dtype=np.int64)
    tree_start = 0
    for i in range(1, n):
        if i in set(np.linspace(0, n, roots, endpoint=False, dtype=int).tolist()):
            tree_start = i  # a new tree: its first token is a root
            continue
        if depth_first and rng.random() < 0.8:
            parent[i] = i - 1  # continue the chain
        else:
            parent[i] = int(rng.integers(tree_start, i))
    return parent


class _Attn(torch.nn.Module):
    num_key_value_groups = 2


@pytest.mark.parametrize(("seed", "depth_first", "block"), [(0, True, 4), (1, True, 16), (2, False, 3), (3, False, 64)])
def test_tree_attention_equals_dense_mask(seed, depth_first, block):
    """Output and gradients of the segment kernel equal sdpa with the dense ancestor mask (GQA, 2 trees)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    n, h, hk, d = 90, 4, 2, 8
    parent = random_parents(rng, n, roots=2, depth_first=depth_first)
    plan = build_plan(parent, block)
    assert len(plan.segments) > 2 and any(s.context for s in plan.segments)
    q, k, v = (torch.randn(1, heads, n, d, requires_grad=True) for heads in (h, hk, hk))
    out, _ = tree_attention_forward(_Attn(), q, k, v, plan)
    mask = torch.from_numpy(dense_mask(parent))[None, None]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    assert float((out - ref).abs().max().detach()) < 1e-5
    w = torch.randn_like(ref)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    assert max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads, strict=True)) < 1e-5
    # the work is what the tree needs: sum over tokens of (ancestors + itself)
    assert plan.pairs == int(dense_mask(parent).sum())


def test_a_chain_is_one_causal_segment_without_a_mask():
    n = 4096
    plan = build_plan(np.arange(n) - 1, block=128)
    assert [(s.start, s.end, s.context) for s in plan.segments] == [(0, n, [])]
    assert plan.mask_width == 0 and plan.pairs == n * (n + 1) // 2
    q = torch.randn(1, 2, n, 8)
    out, _ = tree_attention_forward(torch.nn.Module(), q, q, q, plan)
    assert out.shape == (1, n, 2, 8) and not plan._masks  # is_causal kernel: no mask was built


def test_long_trunk_with_short_branches_has_no_square_mask():
    """A 2000-token shared prompt with 8 branches of 20 tokens: each branch sees the trunk's keys; the only
    mask is block x (trunk + branch), and the work is exactly the ancestor pairs (no n x n)."""
    trunk, branches, length = 2000, 8, 20
    parent = [-1, *range(trunk - 1)]
    for _ in range(branches):
        parent += [trunk - 1] + [len(parent) + j for j in range(length - 1)]
    plan = build_plan(np.asarray(parent), block=16)
    n = trunk + branches * length
    assert len(plan.segments) == branches  # the first branch continues the trunk's segment
    assert plan.mask_width == trunk + length
    assert plan.pairs == int(dense_mask(np.asarray(parent)).sum())
    q = torch.randn(1, 2, n, 8)
    tree_attention_forward(torch.nn.Module(), q, q, q, plan)
    (mask,) = plan._masks.values()
    assert mask.shape == (16, trunk + length)


def test_a_long_path_packs_into_one_masked_free_micro_batch():
    tokens = np.random.default_rng(0).integers(1, 40, 600).tolist()
    tree = build_tree(
        "t",
        [
            dict(tokens=tokens, n_prompt=500, rollout_id="r0"),
            dict(tokens=[*tokens[:520], 41], n_prompt=520, rollout_id="r1"),
        ],
    )
    infos = {"r0": RolloutInfo("r0", "g", "h", 1.0), "r1": RolloutInfo("r1", "g", "h", 0.0)}
    cfg = make_config(max_tokens_per_micro_batch=64)
    batch = build_batch([tree], infos, cfg, policy_version=None)
    (mb,) = pack_trees(batch, 64, block=32)
    assert mb.n_tokens == 601 and mb.attention_mask is None and mb.tree is not None
    assert [s.context for s in mb.tree.segments] == [[], [(0, 520)]]


def saved_bytes(parent: np.ndarray) -> int:
    """Bytes the autograd graph of one tree-attention forward keeps for backward (distinct storages)."""
    n = len(parent)
    plan = build_plan(parent, block=64)
    q = torch.randn(1, 4, n, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, n, 16, requires_grad=True) for _ in range(2))
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tree_attention_forward(_Attn(), q, k, v, plan)
    return sum(kept.values())


def trunk_and_two_branches(trunk: int, branch: int) -> np.ndarray:
    parent = [-1, *range(trunk - 1), trunk - 1, *range(trunk, trunk + branch - 1)]
    parent += [trunk - 1, *range(len(parent), len(parent) + branch - 1)]
    return np.asarray(parent)


@pytest.mark.parametrize("shape", ["chain", "trunk and long branches"])
def test_memory_kept_for_backward_grows_linearly(shape):
    """Doubling the row doubles what attention keeps for backward (a dense mask or score matrix would
    quadruple): no n x n tensor, also where a long branch attends to a shared trunk through block masks."""
    if shape == "chain":
        small, large = np.arange(2048) - 1, np.arange(4096) - 1
    else:
        small, large = trunk_and_two_branches(1000, 1500), trunk_and_two_branches(2000, 3000)
    a, b = saved_bytes(small), saved_bytes(large)
    assert len(large) == 2 * len(small)
    assert 1.9 < b / a < 2.1, (a, b)
    assert b / len(large) < 4 * 1024  # per token: q, k, v, output, gathered context, log-sum-exp
