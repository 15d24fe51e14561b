"""A training batch: kept trees, and one contribution per (generated token, sequence that generated it).

The contribution table is the flat per-sequence view of the loss: the packed forward computes each unique
token once, and the loss gathers the token's logprob into every contribution. Per-contribution terms
(ratio against that sequence's captured logprob, that sequence's advantage, PPO clipping) are computed
separately and summed with global aggregation coefficients, so the packed loss EQUALS the flat one, also
where clipping makes the per-sequence term non-linear in the advantage, and micro-batching is exact.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from dataclasses import dataclass, field

import numpy as np

from clawpipe.errors import TrainingError
from clawpipe.train import advantages as adv_mod
from clawpipe.train.config import TrainConfig
from clawpipe.train.data import RolloutInfo, TrainSequence, TrainTree

log = logging.getLogger(__name__)

# Largest reward magnitude trained on: advantages reach at most 4x the group's reward spread (leave-one-out
# or local + global tree terms, 2x each), so 16x this stays inside float32.
REWARD_LIMIT = float(np.finfo(np.float32).max) / 16
_NOT_IN_METRIC_NAMES = re.compile(r"[^A-Za-z0-9_.-]")


def harness_metric_name(harness: str) -> str:
    """The harness as one part of a metric name (``reward/mean/<part>``). Harness names in the lake are free text,
    and MLflow refuses a whole batch of metrics over one name with another character or a part that resolves
    elsewhere as a path (``..``); such a name is spelt with ``_`` instead and a short hash of the original, so
    two harnesses never share metrics."""
    if harness not in ("", ".", "..") and len(harness) <= 64 and not _NOT_IN_METRIC_NAMES.search(harness):
        return harness
    digest = hashlib.sha1(harness.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{_NOT_IN_METRIC_NAMES.sub('_', harness)[:64].strip('.') or 'harness'}-{digest}"


@dataclass
class Contributions:
    """Flat loss entries, one per (generated token, sequence); arrays of length C."""

    tree: np.ndarray  # (C,) int64 index into TrainBatch.trees
    pos: np.ndarray  # (C,) int64 packed position in that tree
    seq: np.ndarray  # (C,) int64 global sequence index (TrainBatch.sequences)
    idx: np.ndarray  # (C,) int64 index of the token within its sequence
    rollout: np.ndarray  # (C,) int64 index into TrainBatch.rollouts
    harness: np.ndarray  # (C,) int64 index into TrainBatch.harnesses
    old_logprob: np.ndarray  # (C,) float32 captured sampling logprob
    stale: np.ndarray  # (C,) bool: sampled by an older policy_version
    adv: np.ndarray  # (C,) float32
    coef: np.ndarray  # (C,) float64 aggregation coefficient (sum of coef x term = loss)
    returns: np.ndarray | None = None  # (C,) PPO value targets
    v_old: np.ndarray | None = None  # (C,) PPO pre-step values

    def __len__(self) -> int:
        return len(self.pos)


@dataclass
class TrainBatch:
    trees: list[TrainTree]
    rollouts: list[RolloutInfo]
    harnesses: list[str]
    contrib: Contributions
    sequences: list[tuple[int, TrainSequence]]  # (tree index, sequence) in global sequence order
    stats: dict[str, float] = field(default_factory=dict)
    # rollouts of the trained groups with no token to train (every answer empty): outcomes of the same policy,
    # so their rewards still count in their group's baseline
    untrained: list[RolloutInfo] = field(default_factory=list)

    @property
    def unique_tokens(self) -> int:
        return int(sum(t.n_tokens for t in self.trees))

    @property
    def flattened_tokens(self) -> int:
        return int(sum(t.flattened_tokens for t in self.trees))


def check_rewards(trees: list[TrainTree], rollouts: dict[str, RolloutInfo]) -> None:
    """Every rollout with a sequence must have a row in rollouts; the error names the rollout. (A rollout
    without a finite reward is not an error: :func:`build_batch` leaves its group out and counts it.)"""
    for tree in trees:
        for s in tree.sequences:
            if s.rollout_id not in rollouts:
                raise TrainingError(
                    f"rollout {s.rollout_id} (tree {tree.tree_id}, call {s.call_id}) has no row in rollouts; "
                    "land its results first (`clawpipe lake land`) or rebuild the trees"
                )


def _finite(reward: float | None) -> bool:
    return reward is not None and math.isfinite(reward)


def _left_out_for_rewards(
    missing: list[str], no_reward: set[adv_mod.GroupKey], out_of_range: set[adv_mod.GroupKey], rollouts: dict
) -> str:
    """What the groups left out for their rewards were, with examples, for the log and the error."""
    parts = []
    if no_reward:
        examples = ", ".join(f"{r} (reward {rollouts[r].reward!r}, group {rollouts[r].group_id})" for r in missing[:3])
        parts.append(f"{len(no_reward)} group(s) with a rollout without a finite reward ({len(missing)}: {examples})")
    if out_of_range:
        parts.append(f"{len(out_of_range)} group(s) with a reward beyond +-{REWARD_LIMIT:.3g}")
    return "; ".join(parts)


def within_vocabulary(trees: list[TrainTree], vocab_size: int) -> tuple[list[TrainTree], list[str]]:
    """The trees without the sequences whose path holds a token id outside ``[0, vocab_size)``, each pruned to
    the sequences kept, and the call ids left out.

    The lake keeps any int32 id an engine reported (a model served with a larger vocabulary than the one
    trained, a corrupt or forged answer); one such id would stop the whole step (an embedding index error, a
    device-side assert on a GPU), so its call is left out alone."""
    out: list[TrainTree] = []
    left_out: list[str] = []
    for tree in trees:
        ids = tree.token_ids
        bad = (ids < 0) | (ids >= vocab_size)
        if not bad.any():
            out.append(tree)
            continue
        keep = [s for s in tree.sequences if not bad[s.positions].any()]
        left_out += [s.call_id for s in tree.sequences if bad[s.positions].any()]
        if keep:
            out.append(tree.pruned(keep))
    return out, left_out


def within_context(trees: list[TrainTree], max_positions: int) -> tuple[list[TrainTree], list[str]]:
    """The trees without the sequences whose path is longer than the model's positions, each pruned to the
    sequences kept, and the call ids left out.

    A call served with a longer context than the trained model has (another engine, a rope-scaled window)
    would put its last tokens at positions the model has no embedding for (an index error) or was never
    trained at; cutting it would train a completion without its end, so the call is left out alone."""
    out: list[TrainTree] = []
    left_out: list[str] = []
    for tree in trees:
        keep = [s for s in tree.sequences if len(s.positions) <= max_positions]
        left_out += [s.call_id for s in tree.sequences if len(s.positions) > max_positions]
        if len(keep) == len(tree.sequences):
            out.append(tree)
        elif keep:
            out.append(tree.pruned(keep))
    return out, left_out


def build_batch(
    trees: list[TrainTree],
    rollouts: dict[str, RolloutInfo],
    config: TrainConfig,
    *,
    policy_version: int | None,
    vocab_size: int | None = None,
    max_positions: int | None = None,
) -> TrainBatch:
    """Drop unusable trees, calls with token ids outside the policy's vocabulary (``vocab_size``, when given)
    or longer than its positions (``max_positions``, when given), groups without usable rewards and
    zero-variance groups (a group of one rollout among them), then lay out contributions, advantages and
    coefficients. Raises when every group was left out for its rewards."""
    check_rewards(trees, rollouts)
    stats: dict[str, float] = {"trees_in": len(trees)}
    # every rollout of the batch, before calls are left out below: a rollout whose calls are all left out (too
    # long, ids outside the vocabulary) is still an outcome of the policy, so its reward stays in its group's
    # baseline (as an all-empty rollout's does)
    used = {s.rollout_id for t in trees for s in t.sequences}
    if max_positions is not None:
        trees, long = within_context(trees, max_positions)
        stats["calls_longer_than_context"] = len(long)
        if long:
            log.warning(
                "%d call(s) left out of the step: longer than the model's %d positions (first: %s)",
                len(long),
                max_positions,
                long[0],
            )
    if vocab_size is not None:
        trees, odd = within_vocabulary(trees, vocab_size)
        stats["calls_token_ids_out_of_vocab"] = len(odd)
        if odd:
            log.warning(
                "%d call(s) left out of the step: a token id outside the policy's vocabulary of %d (first: %s)",
                len(odd),
                vocab_size,
                odd[0],
            )
    keys = {r: adv_mod.group_key(rollouts[r], config.group_by) for r in used}
    # A rollout without a finite reward (null: its verifier returned none; NaN, inf) leaves its group without a
    # baseline: that group is left out alone and counted, and the step goes on with the others (failing the
    # whole step would fail every retry of a scheduled run the same way).
    missing = sorted(r for r in used if not _finite(rollouts[r].reward))
    no_reward = {keys[r] for r in missing}
    rewards = {r: float(rollouts[r].reward) for r in used if keys[r] not in no_reward}
    # Advantages and returns are float32 on the device: one group's reward beyond REWARD_LIMIT (finite in the
    # lake's float64) could make them inf and the whole step's loss NaN, so that group is left out alone.
    out_of_range = {keys[r] for r, v in rewards.items() if abs(v) > REWARD_LIMIT}
    rewards = {r: v for r, v in rewards.items() if keys[r] not in out_of_range}
    if no_reward or out_of_range:
        left_out = _left_out_for_rewards(missing, no_reward, out_of_range, rollouts)
        if not rewards:  # bad data, unlike zero variance (an empty step): a retry would not change it
            raise TrainingError(
                f"every group of the batch was left out for its rewards, nothing to train on: {left_out}; "
                "fix the task verifier (rewards must be finite numbers) and land the results again, or leave "
                "those rollouts out via skip_statuses"
            )
        log.warning("left out of training: %s", left_out)
    moments = adv_mod.group_moments(rewards, keys)
    if rewards:
        all_r = np.asarray(list(rewards.values()))
        stats["reward/mean"], stats["reward/std"] = float(all_r.mean()), float(all_r.std())
        for h in sorted({rollouts[r].harness for r in rewards}):
            hr = np.asarray([v for r, v in rewards.items() if rollouts[r].harness == h])
            name = harness_metric_name(h)
            stats[f"reward/mean/{name}"], stats[f"reward/std/{name}"] = float(hr.mean()), float(hr.std())
    skip_groups: set[adv_mod.GroupKey] = set()
    if config.algorithm == "grpo":
        skip_groups = {k for k, (_, std, n) in moments.items() if n < 2 or std < 1e-8}
    stats["groups"] = len(moments) + len(out_of_range) + len(no_reward)
    stats["groups_skipped_zero_variance"] = len(skip_groups)
    # a group of one has no baseline to compare with (GRPO leaves it out, as zero variance)
    stats["groups_single_rollout"] = sum(1 for _, _, n in moments.values() if n < 2)
    stats["groups_skipped_reward_range"] = len(out_of_range)
    stats["groups_skipped_no_reward"] = len(no_reward)
    stats["rollouts_no_reward"] = len(missing)
    skip_groups |= out_of_range | no_reward

    kept: list[TrainTree] = []
    no_gen = 0
    # an empty completion trains no token; its rollout's reward still counts in its group's baseline
    stats["sequences_no_generated_tokens"] = sum(1 for t in trees for s in t.sequences if len(s.gen_positions) == 0)
    for tree in trees:
        seqs = [s for s in tree.sequences if keys[s.rollout_id] not in skip_groups and len(s.gen_positions) > 0]
        if not seqs:
            if not any(len(s.gen_positions) for s in tree.sequences):
                no_gen += 1
            continue
        kept.append(tree.pruned(seqs))  # also drops tokens no kept sequence passes through
    stats["trees_no_generated_tokens"] = no_gen
    stats["trees"] = len(kept)
    if trees and no_gen == len(trees):
        raise TrainingError(
            f"none of the {len(trees)} trees has a generated token: nothing to train on (were all calls "
            "retokenized or failed? see tree_stats)"
        )

    rids = sorted({s.rollout_id for t in kept for s in t.sequences})
    r_index = {r: i for i, r in enumerate(rids)}
    infos = [rollouts[r] for r in rids]
    harnesses = sorted({i.harness for i in infos})
    h_index = {h: i for i, h in enumerate(harnesses)}

    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("tree", "pos", "seq", "idx", "rollout", "old", "stale")}
    sequences: list[tuple[int, TrainSequence]] = []
    dropped_first = 0
    seq_id = 0
    for ti, tree in enumerate(kept):
        for s in tree.sequences:
            g = s.gen_positions
            ok = tree.prev[g] >= 0  # a tree's very first token has nothing to predict it
            dropped_first += int((~ok).sum())
            g = g[ok]
            cols["tree"].append(np.full(len(g), ti))
            cols["pos"].append(g)
            cols["seq"].append(np.full(len(g), seq_id))
            cols["idx"].append(np.flatnonzero(ok) + s.n_prompt)
            cols["rollout"].append(np.full(len(g), r_index[s.rollout_id]))
            cols["old"].append(np.asarray(s.old_logprobs, dtype=np.float32)[ok])
            stale = s.policy_version is not None and policy_version is not None and s.policy_version < policy_version
            cols["stale"].append(np.full(len(g), stale))
            sequences.append((ti, s))
            seq_id += 1
    cat = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in cols.items()}
    rollout_idx = cat["rollout"].astype(np.int64)
    harness_of_rollout = np.asarray([h_index[i.harness] for i in infos], dtype=np.int64)
    contrib = Contributions(
        tree=cat["tree"].astype(np.int64),
        pos=cat["pos"].astype(np.int64),
        seq=cat["seq"].astype(np.int64),
        idx=cat["idx"].astype(np.int64),
        rollout=rollout_idx,
        harness=harness_of_rollout[rollout_idx] if len(rollout_idx) else rollout_idx,
        old_logprob=cat["old"].astype(np.float32),
        stale=cat["stale"].astype(bool),
        adv=np.zeros(len(rollout_idx), dtype=np.float32),
        coef=np.zeros(len(rollout_idx), dtype=np.float64),
    )
    stats["contributions_dropped_first_token"] = dropped_first
    untrained = [rollouts[r] for r in sorted(rewards) if keys[r] not in skip_groups and r not in r_index]
    batch = TrainBatch(kept, infos, harnesses, contrib, sequences, stats, untrained)
    batch.contrib.coef = aggregation_coefficients(batch, config)
    if config.algorithm == "grpo":
        batch.contrib.adv = grpo_advantages(batch, config).astype(np.float32)
    stats["sequences"] = seq_id
    for h in harnesses:  # what the step trains of each harness (zero-variance groups are left out above)
        stats[f"sequences/{harness_metric_name(h)}"] = sum(rollouts[s.rollout_id].harness == h for _, s in sequences)
    stats["rollouts"] = len(infos)
    return batch


def grpo_advantages(batch: TrainBatch, config: TrainConfig) -> np.ndarray:
    """Per-contribution advantage for GRPO's outcome or TreeRL tree modes."""
    c = batch.contrib
    members = [*batch.rollouts, *batch.untrained]  # the baseline is the whole group's
    rewards = {i.rollout_id: float(i.reward) for i in members}
    keys = {i.rollout_id: adv_mod.group_key(i, config.group_by) for i in members}
    if config.advantage == "outcome":
        per = adv_mod.outcome_advantages(rewards, keys, scale_std=config.scale_std, leave_one_out=config.leave_one_out)
        table = np.asarray([per[i.rollout_id] for i in batch.rollouts], dtype=np.float64)
        return table[c.rollout] if len(c) else np.zeros(0)
    moments = adv_mod.group_moments(rewards, keys)
    std_of_rollout = np.asarray([moments[keys[i.rollout_id]][1] for i in batch.rollouts], dtype=np.float64)
    # each tree's contributions, found once (a scan of c.tree per tree grew with trees x contributions)
    by_tree = np.argsort(c.tree, kind="stable")
    bounds = np.searchsorted(c.tree[by_tree], np.arange(len(batch.trees) + 1))
    out = np.zeros(len(c), dtype=np.float64)
    for ti, tree in enumerate(batch.trees):
        rids = {s.rollout_id for s in tree.sequences}
        gkeys = {keys[r] for r in rids}
        # the tree's root value: mean reward of its group (group trees hold one group)
        root = float(np.mean([moments[k][0] for k in gkeys]))
        token_adv = adv_mod.tree_token_advantages(
            tree, rewards, root, mode=config.advantage, leaf_norm=config.tree_leaf_norm
        )
        sel = by_tree[bounds[ti] : bounds[ti + 1]]
        vals = token_adv[c.pos[sel]]
        if config.scale_std:
            vals = vals / (std_of_rollout[c.rollout[sel]] + adv_mod.EPS)
        out[sel] = vals
    return out


def aggregation_coefficients(batch: TrainBatch, config: TrainConfig) -> np.ndarray:
    """Coefficients w_c such that loss = sum_c w_c * term_c implements the configured aggregation.

    token-mean (DAPO): weighted mean over all (token, sequence) entries. seq-mean-token-mean (GRPO): token
    mean per sequence, weighted mean over sequences. seq-mean-token-sum-norm (Dr. GRPO): token sums per
    sequence / norm_tokens, weighted mean over sequences. per-rollout-mean: token mean per rollout, weighted
    mean over rollouts. Weights are the harness weights (1 unless configured).
    """
    c = batch.contrib
    if len(c) == 0:
        return np.zeros(0)
    hw = np.asarray([config.harness_weights.get(h, 1.0) for h in batch.harnesses], dtype=np.float64)
    w = hw[c.harness]  # (C,)
    agg = config.aggregation
    if agg == "token-mean":
        total = w.sum()
        return w / total if total > 0 else np.zeros_like(w)
    if agg in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        n_seq = int(c.seq.max()) + 1
        per_seq = np.bincount(c.seq, minlength=n_seq).astype(np.float64)
        seq_w = np.zeros(n_seq)
        seq_w[c.seq] = w
        denom = seq_w[per_seq > 0].sum()
        if denom <= 0:
            return np.zeros_like(w)
        if agg == "seq-mean-token-mean":
            return w / (per_seq[c.seq] * denom)
        norm = config.norm_tokens or int(per_seq.max())
        return w / (norm * denom)
    # per-rollout-mean
    n_r = len(batch.rollouts)
    per_r = np.bincount(c.rollout, minlength=n_r).astype(np.float64)
    r_w = np.zeros(n_r)
    r_w[c.rollout] = w
    denom = r_w[per_r > 0].sum()
    return w / (per_r[c.rollout] * denom) if denom > 0 else np.zeros_like(w)
