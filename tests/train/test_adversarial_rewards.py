"""Rewards a verifier can leave behind in the lake: null, NaN or inf for one rollout leaves its group out of
the batch, counted; the other groups train. Only a batch with no usable reward at all is an error."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from clawpipe.errors import TrainingError
from clawpipe.train.batch import build_batch, harness_metric_name
from clawpipe.train.config import make_config
from clawpipe.train.data import RolloutInfo, TrainTree
from tests.trees.training import build_tree


def _group(gid: str, rewards: list[float | None]) -> tuple[TrainTree, dict[str, RolloutInfo]]:
    seqs = [dict(tokens=[1, 2, 3 + k, 40 + k], n_prompt=2, rollout_id=f"{gid}r{k}") for k in range(len(rewards))]
    infos = {f"{gid}r{k}": RolloutInfo(f"{gid}r{k}", gid, "h", r) for k, r in enumerate(rewards)}  # type: ignore[arg-type]
    return build_tree(f"group:{gid}", seqs), infos


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize(
    "options", [dict(), dict(advantage="tree_local_global", scale_std=True), dict(leave_one_out=True)]
)
def test_a_rollout_without_a_reward_leaves_only_its_group_out(
    options: dict, bad: float | None, caplog: pytest.LogCaptureFixture
) -> None:
    bad_tree, bad_infos = _group("g0", [1.0, bad, 0.0])
    good_tree, good_infos = _group("g1", [1.0, 0.0, 0.5])
    with caplog.at_level(logging.WARNING, logger="clawpipe.train.batch"):
        batch = build_batch(
            [bad_tree, good_tree], {**bad_infos, **good_infos}, make_config(**options), policy_version=None
        )
    assert batch.stats["groups_skipped_no_reward"] == 1 and batch.stats["rollouts_no_reward"] == 1
    assert batch.stats["groups"] == 2 and batch.stats["groups_skipped_zero_variance"] == 0
    assert [t.tree_id for t in batch.trees] == ["group:g1"]
    assert {i.group_id for i in batch.rollouts} == {"g1"} and batch.stats["rollouts"] == 3
    assert np.isfinite(batch.contrib.adv).all() and np.abs(batch.contrib.adv).max() > 0  # g1 still trains
    assert all(np.isfinite(v) for v in batch.stats.values())
    warned = [r.getMessage() for r in caplog.records if "left out of training" in r.getMessage()]
    assert len(warned) == 1 and "g0r1" in warned[0]  # logged once, naming the rollout


def test_ppo_leaves_a_group_without_a_reward_out_too() -> None:
    bad_tree, bad_infos = _group("g0", [None, 1.0])
    good_tree, good_infos = _group("g1", [1.0, 1.0])  # zero variance: PPO still trains it
    batch = build_batch(
        [bad_tree, good_tree], {**bad_infos, **good_infos}, make_config(algorithm="ppo"), policy_version=None
    )
    assert batch.stats["groups_skipped_no_reward"] == 1 and batch.stats["rollouts_no_reward"] == 1
    assert sorted(i.rollout_id for i in batch.rollouts) == ["g1r0", "g1r1"] and len(batch.contrib) > 0
    assert all(np.isfinite(i.reward) for i in batch.rollouts)


def test_a_batch_with_no_usable_reward_says_so() -> None:
    t0, i0 = _group("g0", [None, 1.0])
    t1, i1 = _group("g1", [float("nan"), None])
    t2, i2 = _group("g2", [1e300, 0.0])  # beyond float32: left out for its reward as well
    with pytest.raises(TrainingError, match=r"every group .* left out for its rewards.*g0r0.*fix the task verifier"):
        build_batch([t0, t1, t2], {**i0, **i1, **i2}, make_config(), policy_version=None)


def test_groups_left_without_a_reward_beside_zero_variance_ones_make_an_empty_step() -> None:
    # the groups that have rewards all agree: nothing to learn from them, which is no error (as before)
    t0, i0 = _group("g0", [None, 1.0])
    t1, i1 = _group("g1", [0.5, 0.5])
    batch = build_batch([t0, t1], {**i0, **i1}, make_config(), policy_version=None)
    assert len(batch.contrib) == 0 and batch.trees == []
    assert batch.stats["groups_skipped_no_reward"] == 1 and batch.stats["groups_skipped_zero_variance"] == 1


def test_a_sequence_whose_rollout_has_no_row_is_still_an_error() -> None:
    tree, infos = _group("g0", [1.0, 0.0])
    del infos["g0r1"]
    with pytest.raises(TrainingError, match=r"rollout g0r1 .* has no row in rollouts"):
        build_batch([tree], infos, make_config(), policy_version=None)


def test_harness_metric_names_keep_plain_names_and_tell_odd_ones_apart() -> None:
    assert harness_metric_name("claude-code_2.1") == "claude-code_2.1"
    odd = ["a@b", "a+b", "a/../b", "..", ".", "", "x" * 300, "é"]
    names = [harness_metric_name(h) for h in odd]
    assert len(set(names)) == len(odd)
    for n in names:
        assert re.fullmatch(r"[A-Za-z0-9_.-]{1,80}", n) and n not in (".", ".."), n
