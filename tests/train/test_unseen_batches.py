"""Batches a trainer has not met before: groups of one rollout, groups whose rewards are all equal (zero
advantages), a call longer than the model's positions, and empty completions. None of them crashes the step or
puts a NaN in its metrics; each is left out and counted, and the step says what it trained."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from clawpipe.train.batch import build_batch
from clawpipe.train.config import make_config
from clawpipe.train.data import RolloutInfo, TrainTree
from clawpipe.train.trainer import Trainer
from tests.train.helpers import VOCAB, tiny_model
from tests.trees.training import build_tree

MAX_POSITIONS = 512  # tiny_model's


def group(gid: str, rewards: list[float], lengths: list[int] | None = None, prompt: int = 6) -> tuple[TrainTree, dict]:
    """One group tree: rollout k answers a shared prompt with lengths[k] generated ids (default 4)."""
    rng = np.random.default_rng(abs(hash(gid)) % 2**32)
    head = rng.integers(1, VOCAB, prompt).tolist()
    seqs, infos = [], {}
    for k, r in enumerate(rewards):
        rid = f"{gid}r{k}"
        comp = rng.integers(1, VOCAB, (lengths or [4] * len(rewards))[k]).tolist()
        seqs.append(dict(tokens=head + comp, n_prompt=prompt, rollout_id=rid, old_logprobs=[-1.0] * len(comp)))
        infos[rid] = RolloutInfo(rid, gid, "h", r)
    return build_tree(f"group:{gid}", seqs), infos


def finite(metrics: dict[str, float]) -> bool:
    return all(math.isfinite(v) for v in metrics.values())


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("options", [dict(), dict(scale_std=True), dict(leave_one_out=True)])
def test_groups_of_one_rollout_make_an_empty_step_that_says_why(options: dict) -> None:
    (t0, i0), (t1, i1) = group("a", [1.0]), group("b", [0.0])
    batch = build_batch([t0, t1], {**i0, **i1}, make_config(**options), policy_version=None)
    assert batch.stats["groups_single_rollout"] == 2 and len(batch.contrib) == 0
    model = tiny_model()
    before = weights(model)
    metrics = Trainer(model, make_config(**options)).step(batch)
    assert metrics["empty_step"] == 1.0 and metrics["tokens/trained"] == 0 and finite(metrics)
    assert all(torch.equal(a, b) for a, b in zip(before, weights(model), strict=True))


@pytest.mark.parametrize("options", [dict(), dict(scale_std=True), dict(advantage="tree_local_global")])
def test_groups_whose_rewards_are_all_equal_train_nothing_and_report_no_nan(options: dict) -> None:
    (t0, i0), (t1, i1) = group("a", [0.5, 0.5, 0.5]), group("b", [1.0, 1.0])
    batch = build_batch([t0, t1], {**i0, **i1}, make_config(**options), policy_version=None)
    assert batch.stats["groups_skipped_zero_variance"] == 2 and batch.stats["groups_single_rollout"] == 0
    metrics = Trainer(tiny_model(), make_config(**options)).step(batch)
    assert metrics["empty_step"] == 1.0 and finite(metrics)
    # beside a group with a spread, only that one trains
    t2, i2 = group("c", [1.0, 0.0])
    batch = build_batch([t0, t2], {**i0, **i2}, make_config(**options), policy_version=None)
    metrics = Trainer(tiny_model(), make_config(**options)).step(batch)
    assert "empty_step" not in metrics and metrics["tokens/trained"] == 8 and finite(metrics)
    assert batch.stats["groups_skipped_zero_variance"] == 1


def test_ppo_trains_a_group_of_equal_rewards_without_nan() -> None:
    t0, i0 = group("a", [1.0, 1.0, 1.0])
    batch = build_batch([t0], i0, make_config(algorithm="ppo"), policy_version=None)
    metrics = Trainer(tiny_model(), make_config(algorithm="ppo")).step(batch)
    assert metrics["tokens/trained"] == 12 and finite(metrics), metrics


def test_a_call_longer_than_the_models_positions_is_left_out_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    long_tree, long_infos = group("a", [1.0, 0.0, 0.5], lengths=[MAX_POSITIONS, 4, 4])  # 6 + 512 > 512
    short_tree, short_infos = group("b", [1.0, 0.0])
    with caplog.at_level(logging.WARNING, logger="clawpipe.train.batch"):
        batch = build_batch(
            [long_tree, short_tree],
            {**long_infos, **short_infos},
            make_config(),
            policy_version=None,
            vocab_size=VOCAB,
            max_positions=MAX_POSITIONS,
        )
    assert batch.stats["calls_longer_than_context"] == 1
    assert max(len(s.positions) for _, s in batch.sequences) <= MAX_POSITIONS
    assert sorted(i.rollout_id for i in batch.rollouts) == ["ar1", "ar2", "br0", "br1"]
    assert any("longer than the model's 512 positions" in r.getMessage() for r in caplog.records)
    # the left-out rollout's reward (1.0) stays in its group's baseline: a's others get 0.0 - 0.5 and 0.5 - 0.5
    # (not -0.25 / +0.25 against a baseline of their two rewards); b's get +-0.5
    assert [i.rollout_id for i in batch.untrained] == ["ar0"]
    assert sorted(set(np.round(batch.contrib.adv, 4).tolist())) == [-0.5, 0.0, 0.5]
    metrics = Trainer(tiny_model(), make_config()).step(batch)
    assert metrics["tokens/trained"] == 16 and finite(metrics)
    # a path of exactly the model's positions still trains
    fits, fits_infos = group("c", [1.0, 0.0], lengths=[MAX_POSITIONS - 6, 4])
    batch = build_batch([fits], fits_infos, make_config(), policy_version=None, max_positions=MAX_POSITIONS)
    assert batch.stats["calls_longer_than_context"] == 0 and len(batch.sequences) == 2


def test_an_empty_completion_trains_zero_tokens_and_is_counted() -> None:
    tree, infos = group("a", [1.0, 0.0, 0.5], lengths=[0, 4, 4])
    batch = build_batch([tree], infos, make_config(), policy_version=None)
    assert batch.stats["sequences_no_generated_tokens"] == 1 and len(batch.sequences) == 2
    assert all(len(s.gen_positions) > 0 for _, s in batch.sequences)
    assert sorted(i.rollout_id for i in batch.rollouts) == ["ar1", "ar2"]
    # its rollout's reward still counts in its group's baseline: the others' advantages are r - mean(all three)
    assert sorted(set(np.round(batch.contrib.adv, 4).tolist())) == [-0.5, 0.0]
    metrics = Trainer(tiny_model(), make_config()).step(batch)
    assert metrics["tokens/trained"] == 8 and finite(metrics)


@pytest.mark.parametrize("options", [dict(), dict(scale_std=True), dict(advantage="tree_local_global")])
def test_a_group_whose_only_low_reward_answered_nothing_still_teaches_the_others(options: dict) -> None:
    """The rollout that answered nothing scored 0 and the two that answered 1: the answers are better than
    the group's mean, not advantage-free as they would be against a baseline of their own two rewards."""
    tree, infos = group("a", [0.0, 1.0, 1.0], lengths=[0, 4, 4])
    batch = build_batch([tree], infos, make_config(**options), policy_version=None)
    assert batch.stats["groups_skipped_zero_variance"] == 0 and [i.rollout_id for i in batch.untrained] == ["ar0"]
    assert len(batch.contrib) == 8 and (batch.contrib.adv > 0.1).all(), batch.contrib.adv
    metrics = Trainer(tiny_model(), make_config(**options)).step(batch)
    assert metrics["tokens/trained"] == 8 and finite(metrics)
