"""Packed-tree loss and gradients equal the flat per-sequence computation (float32, ~1e-5)."""

from __future__ import annotations

import itertools

import pytest
import torch

from clawpipe.train.batch import build_batch
from clawpipe.train.config import make_config
from clawpipe.train.trainer import Trainer
from tests.train.helpers import (
    flat_reference_loss,
    long_path_group_tree,
    random_group_trees,
    set_rewards,
    tiny_model,
)

AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "per-rollout-mean"]
ADVANTAGES = ["outcome", "tree_local", "tree_global", "tree_local_global"]
TOL = 1e-5


@pytest.fixture(scope="module")
def data():
    torch.set_num_threads(1)
    trees, infos = random_group_trees(1, versions=(2, 3))
    # rollouts 0 and 1 of each group share their first answer but not their reward: the shared tokens carry
    # opposite advantages, where a summed advantage would break clipping
    set_rewards(infos, {"g0r0": 1.0, "g0r1": 0.0, "g0r2": 0.5, "g0r3": 0.0, "g1r0": 0.0, "g1r1": 1.0})
    return trees, infos


def packed_and_flat(model, trees, infos, cfg, reference=None):
    batch = build_batch(trees, infos, cfg, policy_version=3)
    trainer = Trainer(model, cfg, policy_version=3, reference=reference)
    trainer.optimizer.zero_grad()
    sums = trainer.accumulate(batch, trainer.pack(batch, "tree"))
    packed_grads = [p.grad.clone() for p in trainer.params]
    trainer.optimizer.zero_grad()
    ref = flat_reference_loss(model, batch, cfg, reference)
    ref.backward()
    ref = float(ref.detach())
    flat_grads = [p.grad.clone() for p in trainer.params]
    return batch, sums, ref, packed_grads, flat_grads


def assert_close(sums, ref, packed_grads, flat_grads):
    assert abs(sums["loss/total"] - float(ref)) <= TOL * max(1.0, abs(float(ref)))
    scale = max(float(g.abs().max()) for g in flat_grads)
    err = max(float((a - b).abs().max()) for a, b in zip(packed_grads, flat_grads, strict=True))
    assert err <= TOL * max(1.0, scale), err


@pytest.mark.parametrize(("aggregation", "advantage"), list(itertools.product(AGGREGATIONS, ADVANTAGES)))
def test_packed_equals_flat(data, aggregation, advantage):
    trees, infos = data
    cfg = make_config(aggregation=aggregation, advantage=advantage, max_tokens_per_micro_batch=256)
    batch, sums, ref, pg, fg = packed_and_flat(tiny_model(0), trees, infos, cfg)
    # the batch really exercises what the exactness is about
    assert batch.flattened_tokens > 2 * batch.unique_tokens
    assert batch.contrib.stale.any() and (~batch.contrib.stale).any()
    assert sums["clip_count"] > 0
    if advantage == "outcome":  # tree advantages are per token by definition
        assert_shared_opposite_advantages(batch)
    assert_close(sums, ref, pg, fg)


def assert_shared_opposite_advantages(batch):
    shared: dict = {}
    for t, p, a in zip(batch.contrib.tree, batch.contrib.pos, batch.contrib.adv, strict=True):
        shared.setdefault((t, p), set()).add(round(float(a), 6))
    assert any(len(v) > 1 and min(v) < 0 < max(v) for v in shared.values()), "no token shared by +/- advantages"


@pytest.mark.parametrize("attention", ["dense", "blocks"])
def test_split_trees_entropy_kl_eager_mask(data, attention):
    """Trees cut into pieces (budget below a tree's size), entropy bonus, KL to a reference, eager attention
    (dense: the additive float mask): still equal to the flat computation."""
    trees, infos = data
    cfg = make_config(
        attention=attention,
        attention_block_tokens=8,
        max_tokens_per_micro_batch=24,
        entropy_coef=0.05,
        kl_coef=0.1,
        reference_policy="/unused",
        scale_std=True,
        leave_one_out=True,
        aggregation="seq-mean-token-mean",
    )
    model = tiny_model(0, attn="eager")
    reference = tiny_model(7)
    batch, sums, ref, pg, fg = packed_and_flat(model, trees, infos, cfg, reference=reference)
    trainer = Trainer(tiny_model(0), cfg, reference=reference)
    mbs = trainer.pack(batch, "tree")
    assert len(mbs) > 2 and all(mb.n_tokens <= 24 for mb in mbs)
    assert sum(mb.n_tokens for mb in mbs) > batch.unique_tokens  # pieces repeat their ancestors
    assert "kl" in sums and sums["kl"] > 0
    assert_close(sums, ref, pg, fg)


def test_ppo_tree_layout_equals_flat_layout(data):
    """PPO (values, GAE, clipped value loss): the packed layout and the flat layout give the same loss/grads."""
    trees, infos = data
    cfg = make_config(algorithm="ppo", max_tokens_per_micro_batch=64, aggregation="per-rollout-mean")
    batch = build_batch(trees, infos, cfg, policy_version=3)
    results = []
    for layout in ("tree", "flat"):
        model = tiny_model(0)
        head = torch.nn.Linear(32, 1)
        torch.nn.init.normal_(head.weight, std=0.3)
        trainer = Trainer(model, cfg, policy_version=3, value_head=head)
        trainer.optimizer.zero_grad()
        sums = trainer.accumulate(batch, trainer.pack(batch, layout))
        results.append((sums, [p.grad.clone() for p in trainer.params]))
    (s1, g1), (s2, g2) = results
    assert s1["loss/value"] > 0
    assert abs(s1["loss/total"] - s2["loss/total"]) <= TOL
    assert max(float((a - b).abs().max()) for a, b in zip(g1, g2, strict=True)) <= TOL


def test_micro_batching_does_not_change_the_step(data):
    """One optimizer step gives the same weights whatever the token budget."""
    trees, infos = data
    weights = []
    for budget in (40, 512):
        cfg = make_config(max_tokens_per_micro_batch=budget, learning_rate=1e-2)
        batch = build_batch(trees, infos, cfg, policy_version=3)
        model = tiny_model(0)
        Trainer(model, cfg, policy_version=3).step(batch)
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert float((weights[0] - weights[1]).abs().max()) < 1e-5
    initial = torch.cat([p.detach().flatten() for p in tiny_model(0).parameters()])
    assert float((weights[0] - initial).abs().max()) > 1e-4  # the step did move the weights


LONG_BUDGET = 48  # the long rollout's last path is 140 tokens; the other trees fit


@pytest.fixture(scope="module")
def long_data(data):
    trees, infos = data
    # 60 + 80 tokens on the long path and three 20-30 token branches: more than path + budget, so the long
    # tree itself is cut into two oversized pieces, the second repeating the trunk as context
    tree, more = long_path_group_tree(2, trunk=60, long_turns=(30, 40, 20), short=(40, 60))
    return [*trees, tree], {**infos, **more}


def assert_long_path_alone(trainer, batch, budget):
    """The long tree's micro-batch exceeds the target and holds nothing else; the others keep to it."""
    mbs = trainer.pack(batch, "tree")
    longest = max(int(t.depth.max()) + 1 for t in batch.trees)
    assert longest > budget
    over = [mb for mb in mbs if mb.n_tokens > budget]
    assert len(over) == 2 and all(len(set(batch.contrib.tree[mb.contrib_index])) == 1 for mb in over)
    assert max(mb.n_tokens for mb in over) >= longest
    assert all(mb.n_tokens <= longest + budget for mb in over)
    if trainer.config.attention == "blocks":  # no n x n mask on the linear-memory path
        assert all(mb.attention_mask is None and mb.tree is not None for mb in mbs)


@pytest.mark.parametrize("attention", ["blocks", "dense"])
def test_grpo_path_longer_than_the_target(long_data, attention):
    """A path longer than max_tokens_per_micro_batch trains (no error) and the packed loss and gradients still
    equal the flat computation, with trees split into pieces around it."""
    trees, infos = long_data
    cfg = make_config(
        attention=attention,
        attention_block_tokens=8,
        max_tokens_per_micro_batch=LONG_BUDGET,
        aggregation="seq-mean-token-mean",
        entropy_coef=0.05,
    )
    model = tiny_model(0, attn="eager")
    batch, sums, ref, pg, fg = packed_and_flat(model, trees, infos, cfg)
    assert_long_path_alone(Trainer(tiny_model(0), cfg, policy_version=3), batch, LONG_BUDGET)
    assert_close(sums, ref, pg, fg)


def test_ppo_path_longer_than_the_target(long_data):
    """PPO with a path longer than the target: tree layout == flat layout (the flat row of the long sequence
    is a group of its own), and == the tree layout at a budget large enough for everything."""
    trees, infos = long_data
    results = []
    for layout, budget in (("tree", LONG_BUDGET), ("flat", LONG_BUDGET), ("tree", 4096)):
        cfg = make_config(algorithm="ppo", max_tokens_per_micro_batch=budget, attention_block_tokens=8)
        batch = build_batch(trees, infos, cfg, policy_version=3)
        head = torch.nn.Linear(32, 1)
        torch.nn.init.normal_(head.weight, std=0.3)
        trainer = Trainer(tiny_model(0), cfg, policy_version=3, value_head=head)
        if budget == LONG_BUDGET and layout == "tree":
            assert_long_path_alone(trainer, batch, LONG_BUDGET)
        trainer.optimizer.zero_grad()
        sums = trainer.accumulate(batch, trainer.pack(batch, layout))
        results.append((sums, [p.grad.clone() for p in trainer.params]))
    s0, g0 = results[0]
    assert s0["loss/value"] > 0
    for s, g in results[1:]:
        assert abs(s0["loss/total"] - s["loss/total"]) <= TOL
        assert max(float((a - b).abs().max()) for a, b in zip(g0, g, strict=True)) <= TOL


def test_activation_checkpointing_gives_the_same_gradients(long_data):
    """Checkpointed layers recompute the tree attention in backward: same loss and gradients as without."""
    trees, infos = long_data
    results = []
    for ckpt in (False, True):
        cfg = make_config(
            max_tokens_per_micro_batch=LONG_BUDGET, attention_block_tokens=8, activation_checkpointing=ckpt
        )
        batch = build_batch(trees, infos, cfg, policy_version=3)
        trainer = Trainer(tiny_model(0), cfg, policy_version=3)
        assert trainer.model.is_activation_checkpointing == ckpt
        trainer.optimizer.zero_grad()
        sums = trainer.accumulate(batch, trainer.pack(batch, "tree"))
        results.append((sums, [p.grad.clone() for p in trainer.params]))
    (s1, g1), (s2, g2) = results
    assert abs(s1["loss/total"] - s2["loss/total"]) <= TOL
    assert max(float((a - b).abs().max()) for a, b in zip(g1, g2, strict=True)) <= TOL
