"""Training batches from groups that are valid in the lake but hostile to the loss: rewards at float limits."""

from __future__ import annotations

import numpy as np
import pytest

from clawpipe.train.batch import build_batch
from clawpipe.train.config import make_config
from clawpipe.train.data import RolloutInfo
from tests.trees.training import build_tree

F32_MAX = float(np.finfo(np.float32).max)


def _group(gid: str, rewards: list[float]) -> tuple[object, dict[str, RolloutInfo]]:
    seqs = [dict(tokens=[1, 2, 3 + k, 40 + k], n_prompt=2, rollout_id=f"{gid}r{k}") for k in range(len(rewards))]
    infos = {f"{gid}r{k}": RolloutInfo(f"{gid}r{k}", gid, "h", r) for k, r in enumerate(rewards)}
    return build_tree(gid, seqs), infos


@pytest.mark.parametrize(
    ("options", "extreme"),
    [
        (dict(leave_one_out=True), [F32_MAX, -F32_MAX]),  # r - mean(others) = 2 x float32 max
        (dict(), [1e300, -1e300, 0.0]),  # finite in the lake's float64, far beyond float32
        (dict(advantage="tree_local_global"), [F32_MAX, -F32_MAX]),
    ],
)
def test_a_group_whose_rewards_overflow_float32_is_left_out_and_counted(options: dict, extreme: list[float]) -> None:
    bad_tree, bad_infos = _group("g0", extreme)
    good_tree, good_infos = _group("g1", [1.0, 0.0, 0.5])
    batch = build_batch([bad_tree, good_tree], {**bad_infos, **good_infos}, make_config(**options), policy_version=None)
    assert np.isfinite(batch.contrib.adv).all() and np.isfinite(batch.contrib.coef).all()
    assert batch.stats["groups_skipped_reward_range"] == 1
    assert {i.group_id for i in batch.rollouts} == {"g1"}
    assert np.abs(batch.contrib.adv).max() > 0  # the good group still trains
    assert all(np.isfinite(v) for v in batch.stats.values())
