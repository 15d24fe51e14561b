"""Small random trees and a small random Qwen2 model for training tests (no tokenizer, no lake)."""

from __future__ import annotations

import numpy as np
import torch

from clawpipe.serving.policy import build_qwen2
from clawpipe.train.data import RolloutInfo, TrainTree
from tests.trees.training import build_tree

VOCAB = 48


def tiny_model(seed: int = 0, attn: str = "sdpa") -> torch.nn.Module:
    shape = {"hidden": 32, "intermediate": 64, "layers": 2, "heads": 4, "kv_heads": 2}
    return build_qwen2(**shape, vocab=VOCAB, max_positions=512, seed=seed, attn=attn)


def random_group_trees(
    seed: int = 0, *, n_groups: int = 2, group_size: int = 4, prompt_len: int = 12, versions: tuple[int, ...] = (3,)
) -> tuple[list[TrainTree], dict[str, RolloutInfo]]:
    """Group trees: a shared prompt; multi-turn rollouts; some identical first answers (shared generated
    tokens with different advantages); retries; calls from several policy versions; rewards in [0, 1]."""
    rng = np.random.default_rng(seed)
    trees, infos = [], {}
    for g in range(n_groups):
        prompt = rng.integers(1, VOCAB, prompt_len).tolist()
        common_answer = rng.integers(1, VOCAB, 4).tolist()
        seqs = []
        for i in range(group_size):
            rid = f"g{g}r{i}"
            harness = "alpha" if i % 2 == 0 else "beta"
            infos[rid] = RolloutInfo(rid, f"g{g}", harness, float(rng.integers(0, 3)) / 2)
            ctx = list(prompt)
            for turn in range(int(rng.integers(1, 4))):
                if turn == 0 and i < 2:
                    comp = list(common_answer)  # rollouts 0 and 1 generate the same first answer
                else:
                    comp = rng.integers(1, VOCAB, int(rng.integers(2, 6))).tolist()
                lps = (-rng.random(len(comp)) * 3).tolist()
                pv = int(rng.choice(versions))
                seqs.append(
                    dict(tokens=ctx + comp, n_prompt=len(ctx), rollout_id=rid, old_logprobs=lps, policy_version=pv)
                )
                if turn == 0 and i == 3:  # a retry: same prompt, another completion
                    retry = rng.integers(1, VOCAB, 3).tolist()
                    seqs.append(
                        dict(
                            tokens=ctx + retry,
                            n_prompt=len(ctx),
                            rollout_id=rid,
                            old_logprobs=(-rng.random(3)).tolist(),
                            policy_version=pv,
                        )
                    )
                ctx = ctx + comp + rng.integers(1, VOCAB, int(rng.integers(1, 4))).tolist()  # tool output
        trees.append(build_tree(f"tree{g}", seqs))
    return trees, infos


def long_path_group_tree(
    group: int, *, trunk: int, long_turns: tuple[int, ...], short: tuple[int, int] = (3, 8), seed: int = 3
) -> tuple[TrainTree, dict[str, RolloutInfo]]:
    """A group tree with one long multi-turn rollout (its last call's path is about trunk + sum(long_turns)
    tokens) and three single-call rollouts of short[0] to short[1] tokens branching off the same trunk."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, VOCAB, trunk).tolist()
    seqs, infos = [], {}
    for i in range(4):
        rid = f"g{group}r{i}"
        infos[rid] = RolloutInfo(rid, f"g{group}", "alpha", float(i % 3) / 2)
        ctx = list(prompt)
        for n in long_turns if i == 0 else (int(rng.integers(*short)),):
            comp = rng.integers(1, VOCAB, n // 2).tolist()
            lps = (-rng.random(len(comp)) * 3).tolist()
            seqs.append(dict(tokens=ctx + comp, n_prompt=len(ctx), rollout_id=rid, old_logprobs=lps, policy_version=3))
            ctx = ctx + comp + rng.integers(1, VOCAB, n - n // 2).tolist()  # tool output
    return build_tree(f"tree-long{group}", seqs), infos


def set_rewards(infos: dict[str, RolloutInfo], rewards: dict[str, float]) -> None:
    for rid, r in rewards.items():
        infos[rid].reward = r


def flat_reference_loss(model, batch, cfg, reference=None) -> torch.Tensor:
    """The flat per-sequence objective written out independently: one ordinary causal forward per
    sequence, per-token terms with that sequence's captured logprob and advantage, summed with the batch's
    aggregation coefficients."""
    c = batch.contrib
    total = torch.zeros(())
    for sid, (ti, s) in enumerate(batch.sequences):
        toks = torch.as_tensor(batch.trees[ti].token_ids[s.positions])
        logits = model(input_ids=toks[None]).logits[0].float() / cfg.sampling_temperature
        logp = torch.log_softmax(logits, -1)
        sel = np.flatnonzero(c.seq == sid)
        k = torch.as_tensor(c.idx[sel])
        lp = logp[k - 1, toks[k]]
        old = torch.as_tensor(c.old_logprob[sel])
        adv = torch.as_tensor(c.adv[sel]).float()
        coef = torch.as_tensor(c.coef[sel]).float()
        stale = torch.as_tensor(c.stale[sel])
        prox = lp.detach()
        ratio = torch.where(stale, torch.exp(lp - prox), torch.exp(lp - old))
        w = torch.where(stale, torch.exp(prox - old).clamp(max=cfg.tis_cap), torch.ones(()))
        term = -w * torch.minimum(ratio * adv, ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv)
        if cfg.entropy_coef:
            ent = -(logp.exp() * logp).sum(-1)[k - 1]
            term = term - cfg.entropy_coef * ent
        if reference is not None:
            with torch.no_grad():
                rl = torch.log_softmax(reference(input_ids=toks[None]).logits[0].float() / cfg.sampling_temperature, -1)
            d = rl[k - 1, toks[k]] - lp
            term = term + cfg.kl_coef * (torch.exp(d) - d - 1)
        total = total + (coef * term).sum()
    return total


def radix_node_rows(tree: TrainTree) -> list[dict]:
    """tree_nodes-style rows (node_id, parent_id, depth, token_ids, generated, ...) for a token-level tree:
    chains of single-child tokens of one kind merged into nodes, parent-first."""
    n = tree.n_tokens
    gen = np.zeros(n, dtype=bool)
    rollouts: list[set[str]] = [set() for _ in range(n)]
    for s in tree.sequences:
        gen[s.gen_positions] = True
        for p in s.positions.tolist():
            rollouts[p].add(s.rollout_id)
    nchild = np.bincount(tree.prev[tree.prev >= 0], minlength=n)
    node_of = np.full(n, -1)
    rows: list[dict] = []
    for i in range(n):
        p = int(tree.prev[i])
        if p >= 0 and nchild[p] == 1 and gen[p] == gen[i]:
            node = rows[node_of[p]]
            node["token_ids"].append(int(tree.token_ids[i]))
            node_of[i] = node_of[p]
        else:
            node_of[i] = len(rows)
            rows.append(
                dict(
                    node_id=len(rows),
                    parent_id=int(node_of[p]) if p >= 0 else -1,
                    depth=int(tree.depth[i]),
                    token_ids=[int(tree.token_ids[i])],
                    generated=bool(gen[i]),
                    rollout_ids=sorted(rollouts[i]),
                    is_leaf=bool(nchild[i] == 0),
                )
            )
        rows[node_of[i]]["is_leaf"] = bool(nchild[i] == 0)
    return rows
