"""Training batches from calls valid in the lake but hostile to the loss and the packing: float limits, sizes."""

from __future__ import annotations

import time

import numpy as np
import pytest

from clawpipe.train.batch import build_batch
from clawpipe.train.config import make_config
from clawpipe.train.data import RolloutInfo, TrainSequence, TrainTree
from clawpipe.train.packing import pack_trees
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


def _chain(tid: str, length: int, rid: str) -> TrainTree:
    """A one-call rollout tree: a chain of ``length`` tokens whose second half is generated."""
    line = np.arange(length, dtype=np.int64)
    tree = TrainTree(tid, line + 5, line - 1, line.copy())
    positions = line.copy()
    tree.sequences.append(
        TrainSequence(f"{tid}-c", rid, positions, length // 2, np.zeros(length - length // 2, np.float32))
    )
    return tree


def _check_packing(batch, micro_batches) -> None:
    """Every contribution is scored once, on its own token, from the row holding its parent token."""
    c = batch.contrib
    base = np.cumsum([0] + [t.n_tokens for t in batch.trees])
    tokens = np.concatenate([t.token_ids for t in batch.trees])
    prev = np.concatenate([np.where(t.prev >= 0, t.prev + base[k], -1) for k, t in enumerate(batch.trees)])
    at = base[c.tree] + c.pos  # each contribution's token, over all trees laid end to end
    seen = np.concatenate([mb.contrib_index for mb in micro_batches])
    assert np.array_equal(np.sort(seen), np.arange(len(c)))
    for mb in micro_batches:
        score = mb.contrib_score.numpy()
        assert np.array_equal(mb.score_targets.numpy()[score], tokens[at[mb.contrib_index]])
        rows = mb.score_rows.numpy()[score]
        assert np.array_equal(mb.input_ids.numpy().ravel()[rows], tokens[prev[at[mb.contrib_index]]])


def _one_call_rollouts(n: int) -> tuple[list[TrainTree], dict[str, RolloutInfo]]:
    """``n`` one-call rollout trees of 300 tokens, in groups of 8, rewards 0, 1, 2 in turn."""
    trees, infos = [], {}
    for i in range(n):
        rid = f"r{i}"
        trees.append(_chain(f"rollout:{rid}", 300, rid))
        infos[rid] = RolloutInfo(rid, f"g{i // 8}", "h", float(i % 3))
    return trees, infos


def test_packing_thousands_of_small_trees_grows_linearly_and_places_every_contribution() -> None:
    # 8,000 one-call rollout trees (rollout scope over a large iteration). Packing scanned every
    # contribution once per tree and once per piece (trees x contributions: about 10 s here).
    trees, infos = _one_call_rollouts(8000)
    batch = build_batch(trees, infos, make_config(), policy_version=None)
    t0 = time.process_time()  # CPU seconds: machine load does not count
    micro_batches = pack_trees(batch, 4096)
    seconds = time.process_time() - t0
    assert len(micro_batches) == -(-8000 // (4096 // 300))  # 13 trees fill each row
    _check_packing(batch, micro_batches)
    assert seconds < 4, f"packing 8,000 trees took {seconds:.1f} CPU s"


def test_a_branched_tree_cut_into_many_pieces_still_scores_each_token_from_its_own_prefix() -> None:
    rng = np.random.default_rng(3)
    prompt = rng.integers(10, 1000, 40).tolist()
    seqs = [
        dict(tokens=prompt + rng.integers(1000, 5000, 30).tolist(), n_prompt=40, rollout_id=f"r{k % 4}")
        for k in range(60)
    ]
    tree = build_tree("group:g", seqs)
    infos = {f"r{k}": RolloutInfo(f"r{k}", "g", "h", float(k)) for k in range(4)}
    batch = build_batch([tree], infos, make_config(), policy_version=None)
    micro_batches = pack_trees(batch, 128)  # about 20 pieces, each repeating the 40-token prompt
    assert len(micro_batches) > 10
    _check_packing(batch, micro_batches)


@pytest.mark.slow
def test_tree_advantages_over_thousands_of_trees_grow_linearly() -> None:
    # Tree advantages scanned every contribution once per tree (8,000 rollout trees: about 9 s here).
    trees, infos = _one_call_rollouts(8000)
    config = make_config(advantage="tree_local_global", scale_std=True)
    t0 = time.process_time()  # CPU seconds: machine load does not count
    batch = build_batch(trees, infos, config, policy_version=None)
    seconds = time.process_time() - t0
    # one chain per rollout: global and local terms are both reward - group mean, over the group std
    rewards = np.asarray([i.reward for i in batch.rollouts])
    by_group = {}
    for info in batch.rollouts:
        by_group.setdefault(info.group_id, []).append(info.reward)
    mean = np.asarray([np.mean(by_group[i.group_id]) for i in batch.rollouts])
    std = np.asarray([np.std(by_group[i.group_id], ddof=1) for i in batch.rollouts])
    expected = 2 * (rewards - mean) / (std + 1e-6)
    assert np.allclose(batch.contrib.adv, expected[batch.contrib.rollout], rtol=1e-5)
    assert seconds < 5, f"tree advantages of 8,000 trees took {seconds:.1f} CPU s"
