"""Advantages, aggregation coefficients and bad-input handling, on hand-built trees (no model)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clawpipe.errors import ConfigError, TrainingError
from clawpipe.train import advantages as A
from clawpipe.train.batch import build_batch
from clawpipe.train.config import load_config, make_config
from clawpipe.train.data import RolloutInfo
from tests.train.helpers import random_group_trees
from tests.trees.training import build_tree


def small_tree(r2: float = 0.2):
    """prompt [1, 2]; r0 answers [3, 4] (reward 1), r1 answers [3, 5] (0), r2 answers [6] (r2)."""
    seqs = [
        dict(tokens=[1, 2, 3, 4], n_prompt=2, rollout_id="r0"),
        dict(tokens=[1, 2, 3, 5], n_prompt=2, rollout_id="r1"),
        dict(tokens=[1, 2, 6], n_prompt=2, rollout_id="r2"),
    ]
    tree = build_tree("t", seqs)
    infos = {r: RolloutInfo(r, "g", "h", v) for r, v in (("r0", 1.0), ("r1", 0.0), ("r2", r2))}
    return tree, infos


def by_token(tree, values):
    return {int(t): round(float(v), 6) for t, v in zip(tree.token_ids, values, strict=True)}


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("tree_global", {3: 0.1, 4: 0.6, 5: -0.4, 6: -0.2}),
        ("tree_local", {3: 0.1, 4: 0.5, 5: -0.5, 6: -0.2}),
        ("tree_local_global", {3: 0.2, 4: 1.1, 5: -0.9, 6: -0.4}),
    ],
)
def test_tree_advantages_by_hand(mode, expected):
    tree, infos = small_tree()
    rewards = {r: i.reward for r, i in infos.items()}
    adv = by_token(tree, A.tree_token_advantages(tree, rewards, 0.4, mode=mode, leaf_norm=False))
    for tok, value in expected.items():
        assert adv[tok] == pytest.approx(value, abs=1e-9), tok
    normed = by_token(tree, A.tree_token_advantages(tree, rewards, 0.4, mode=mode, leaf_norm=True))
    assert normed[3] == pytest.approx(expected[3] / math.sqrt(2), abs=1e-6)  # token 3 has two leaves below


def test_outcome_advantages_mean_loo_std():
    rewards = {"a": 1.0, "b": 0.0, "c": 0.2, "x": 0.7}
    keys = {"a": "g", "b": "g", "c": "g", "x": "h"}
    plain = A.outcome_advantages(rewards, keys, scale_std=False, leave_one_out=False)
    assert plain["a"] == pytest.approx(0.6) and plain["c"] == pytest.approx(-0.2)
    assert plain["x"] == 0.0  # a group of one has no baseline
    loo = A.outcome_advantages(rewards, keys, scale_std=False, leave_one_out=True)
    assert loo["a"] == pytest.approx(1.0 - 0.1) and loo["b"] == pytest.approx(0.0 - 0.6)
    std = A.outcome_advantages(rewards, keys, scale_std=True, leave_one_out=False)
    assert std["a"] == pytest.approx(0.6 / (np.std([1.0, 0.0, 0.2], ddof=1) + A.EPS))


def test_gae_on_a_chain_and_a_shared_token():
    seqs = [
        dict(tokens=[1, 2, 3, 4], n_prompt=1, rollout_id="r0"),
        dict(tokens=[1, 2, 3, 5], n_prompt=1, rollout_id="r1"),
    ]
    tree = build_tree("t", seqs)
    rewards = {"r0": 1.0, "r1": 0.0}
    values = np.asarray([0.0, 0.3, 0.5, 0.2, 0.4])  # per packed position
    values = values[: tree.n_tokens]
    scored = np.asarray([t != 1 for t in tree.token_ids])
    gamma, lam = 0.9, 0.8
    adv = A.gae_token_advantages(tree, rewards, values, scored, gamma=gamma, lam=lam)

    def path_gae(positions, reward):
        v = values[positions]
        out, a = [], 0.0
        for k in range(len(v) - 1, -1, -1):
            nxt = v[k + 1] if k + 1 < len(v) else 0.0
            a = (reward if k == len(v) - 1 else 0.0) + gamma * nxt - v[k] + gamma * lam * a
            out.append(a)
        return out[::-1]

    pos = {int(t): i for i, t in enumerate(tree.token_ids)}
    p0 = path_gae([pos[2], pos[3], pos[4]], 1.0)
    p1 = path_gae([pos[2], pos[3], pos[5]], 0.0)
    assert adv[pos[4]] == pytest.approx(p0[2]) and adv[pos[5]] == pytest.approx(p1[2])
    assert adv[pos[2]] == pytest.approx((p0[0] + p1[0]) / 2)  # shared token: mean over its paths
    assert adv[pos[1]] == 0.0  # context token


@pytest.mark.parametrize(
    "aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "per-rollout-mean"]
)
def test_aggregation_coefficients_match_their_definitions(aggregation):
    trees, infos = random_group_trees(3)
    weights = {"alpha": 2.0, "beta": 0.5}
    cfg = make_config(aggregation=aggregation, harness_weights=weights, norm_tokens=7)
    batch = build_batch(trees, infos, cfg, policy_version=None)
    c = batch.contrib
    x = np.random.default_rng(0).normal(size=len(c))
    got = float((c.coef * x).sum())
    hw = np.asarray([weights[batch.harnesses[h]] for h in c.harness])
    if aggregation == "token-mean":
        want = (hw * x).sum() / hw.sum()
    elif aggregation == "per-rollout-mean":
        groups = {r: np.flatnonzero(c.rollout == r) for r in np.unique(c.rollout)}
        want = sum(hw[g[0]] * x[g].mean() for g in groups.values()) / sum(hw[g[0]] for g in groups.values())
    else:
        groups = {s: np.flatnonzero(c.seq == s) for s in np.unique(c.seq)}
        if aggregation == "seq-mean-token-mean":
            num = sum(hw[g[0]] * x[g].mean() for g in groups.values())
        else:
            num = sum(hw[g[0]] * x[g].sum() / 7 for g in groups.values())
        want = num / sum(hw[g[0]] for g in groups.values())
    assert got == pytest.approx(want, rel=1e-9)


def test_zero_variance_groups_are_skipped_and_counted():
    trees, infos = random_group_trees(2, n_groups=3)
    for rid, info in infos.items():
        if rid.startswith("g1"):
            info.reward = 0.5
    batch = build_batch(trees, infos, make_config(), policy_version=None)
    assert batch.stats["groups_skipped_zero_variance"] == 1
    assert batch.stats["trees"] == 2
    assert all(not i.rollout_id.startswith("g1") for i in batch.rollouts)
    ppo = build_batch(trees, infos, make_config(algorithm="ppo"), policy_version=None)
    assert ppo.stats["groups_skipped_zero_variance"] == 0  # PPO still learns values from them


def test_a_nan_reward_leaves_its_group_out_and_a_missing_row_names_the_rollout():
    trees, infos = random_group_trees(2)
    infos["g0r2"].reward = float("nan")
    batch = build_batch(trees, infos, make_config(), policy_version=None)
    assert batch.stats["groups_skipped_no_reward"] == 1
    assert all(not i.rollout_id.startswith("g0") for i in batch.rollouts)
    infos["g0r2"].reward = 1.0
    del infos["g1r3"]
    with pytest.raises(TrainingError, match="g1r3"):
        build_batch(trees, infos, make_config(), policy_version=None)


def test_trees_without_generated_tokens():
    infos = {"r": RolloutInfo("r", "g", "h", 1.0), "s": RolloutInfo("s", "g", "h", 0.0)}
    empty = build_tree("e", [dict(tokens=[1, 2, 3], n_prompt=3, rollout_id="r")])
    with pytest.raises(TrainingError, match=r"none of the 1 trees has a generated token"):
        build_batch([empty], infos, make_config(), policy_version=None)
    tree, _ = small_tree()
    tree_infos = {**infos, **{r: RolloutInfo(r, "g2", "h", v) for r, v in (("r0", 1.0), ("r1", 0.0), ("r2", 0.3))}}
    batch = build_batch([empty, tree], tree_infos, make_config(), policy_version=None)
    assert batch.stats["trees_no_generated_tokens"] == 1 and batch.stats["trees"] == 1


def test_config_errors_say_what_to_change(tmp_path):
    with pytest.raises(ConfigError, match="reference_policy"):
        make_config(kl_coef=0.1)
    with pytest.raises(ConfigError, match="aggregation"):
        make_config(aggregation="sum")
    with pytest.raises(ConfigError, match="epochs"):
        make_config(epochs=10**9)  # would train one batch for ever
    with pytest.raises(ConfigError, match="include_retokenized = true is not supported"):
        make_config(include_retokenized=True)  # re-encoded calls never enter a tree: it would train nothing of them
    p = tmp_path / "train.toml"
    p.write_text('[train]\nalgorithm = "ppo"\nlearning_rate = 3e-4\nharness_weights = {chat-loop = 2.0}\n')
    cfg = load_config(p, learning_rate=1e-3)
    assert cfg.algorithm == "ppo" and cfg.learning_rate == 1e-3 and cfg.harness_weights == {"chat-loop": 2.0}
    assert cfg.flat_params()["harness_weights.chat-loop"] == "2.0"
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    # a typo names the file and the close key, once (before: every field listed before and after it, no file)
    p.write_text("[train]\nlearning_rat = 3e-4\n")
    with pytest.raises(ConfigError) as info:
        load_config(p)
    message = str(info.value)
    assert message.startswith(f"invalid training config ({p}): learning_rat: unknown key (did you mean learning_rate?)")
    assert message.count("max_grad_norm") == 1
    assert all(f.description for f in type(cfg).model_fields.values())  # help text for every field
