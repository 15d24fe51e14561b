"""The tiny policy learns a trivial task over a few GRPO steps on multi-turn trees, and PPO fits its values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clawpipe.train.batch import build_batch
from clawpipe.train.config import make_config
from clawpipe.train.data import RolloutInfo
from clawpipe.train.trainer import Trainer
from tests.train.helpers import VOCAB, random_group_trees, tiny_model
from tests.trees.training import build_tree

TARGET = 5  # reward: fraction of generated tokens equal to TARGET


@torch.no_grad()
def sample(model, prefix: torch.Tensor, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample n tokens for each row of prefix (B, L); returns ids (B, n) and their logprobs (B, n)."""
    ids, lps = [], []
    x = prefix
    for _ in range(n):
        logp = torch.log_softmax(model(input_ids=x).logits[:, -1].float(), -1)  # (B, V)
        tok = torch.multinomial(logp.exp(), 1, generator=gen)  # (B, 1)
        ids.append(tok)
        lps.append(logp.gather(1, tok))
        x = torch.cat([x, tok], 1)
    return torch.cat(ids, 1), torch.cat(lps, 1)


def rollout_groups(model, step: int, *, groups: int = 4, k: int = 8):
    """Two-turn rollouts: answer, a tool reply, answer again; one group tree per prompt."""
    gen = torch.Generator().manual_seed(1000 + step)
    rng = np.random.default_rng(step)
    model.eval()
    trees, infos = [], {}
    for g in range(groups):
        prompt = torch.as_tensor(rng.integers(6, VOCAB, 6)).repeat(k, 1)  # (k, 6)
        a1, lp1 = sample(model, prompt, 4, gen)
        tool = torch.as_tensor(rng.integers(6, VOCAB, 2)).repeat(k, 1)
        ctx2 = torch.cat([prompt, a1, tool], 1)
        a2, lp2 = sample(model, ctx2, 4, gen)
        seqs = []
        for i in range(k):
            rid = f"s{step}g{g}r{i}"
            reward = float(((a1[i] == TARGET).sum() + (a2[i] == TARGET).sum()) / 8)
            infos[rid] = RolloutInfo(rid, f"g{g}", "h", reward)
            seqs.append(dict(tokens=torch.cat([prompt[i], a1[i]]).tolist(), n_prompt=6, rollout_id=rid,
                             old_logprobs=lp1[i].tolist(), policy_version=step))  # fmt: skip
            seqs.append(dict(tokens=torch.cat([ctx2[i], a2[i]]).tolist(), n_prompt=ctx2.shape[1], rollout_id=rid,
                             old_logprobs=lp2[i].tolist(), policy_version=step))  # fmt: skip
        trees.append(build_tree(f"s{step}g{g}", seqs))
    model.train()
    return trees, infos


@pytest.mark.slow
def test_grpo_on_trees_raises_reward():
    torch.set_num_threads(1)
    model = tiny_model(3)
    cfg = make_config(learning_rate=3e-2, max_grad_norm=1.0, aggregation="seq-mean-token-mean")
    trainer = Trainer(model, cfg)
    rewards = []
    for step in range(10):
        trainer.policy_version = step
        trees, infos = rollout_groups(model, step)
        rewards.append(np.mean([i.reward for i in infos.values()]))
        batch = build_batch(trees, infos, cfg, policy_version=step)
        assert batch.flattened_tokens > batch.unique_tokens  # turn 2 re-reads turn 1, the group shares its prompt
        m = trainer.step(batch)
        assert m["logprob/max_abs_diff_current"] < 1e-4  # sampled by exactly this policy
    assert np.mean(rewards[-3:]) > max(0.5, 5 * np.mean(rewards[:2])), rewards


def test_ppo_value_loss_decreases_on_a_fixed_batch():
    torch.set_num_threads(1)
    trees, infos = random_group_trees(4)
    cfg = make_config(algorithm="ppo", learning_rate=3e-3, value_coef=1.0, value_clip=10.0)
    batch = build_batch(trees, infos, cfg, policy_version=None)
    trainer = Trainer(tiny_model(0), cfg)
    losses = [trainer.step(batch)["loss/value"] for _ in range(15)]
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.gpu
def test_cuda_bf16_step_matches_cpu_float32():
    trees, infos = random_group_trees(6)
    losses = {}
    for device in ("cpu", "cuda"):
        cfg = make_config(device=device, bf16=True, max_tokens_per_micro_batch=64)
        batch = build_batch(trees, infos, cfg, policy_version=None)
        trainer = Trainer(tiny_model(0), cfg)
        mbs = trainer.pack(batch, "tree")
        trainer.optimizer.zero_grad()
        losses[device] = trainer.accumulate(batch, mbs)["loss/total"]
        m = trainer.step(batch)
        assert np.isfinite(m["grad_norm"])
        if device == "cuda":
            assert m["memory/peak_gb"] > 0
            assert next(trainer.model.parameters()).dtype == torch.float32  # autocast, master weights in fp32
    assert abs(losses["cpu"] - losses["cuda"]) < 0.05 * max(1.0, abs(losses["cpu"]))
