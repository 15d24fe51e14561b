"""The trainer: one GRPO or PPO update over a packed tree batch (or the flat baseline layout).

    trainer = Trainer(model, config, policy_version=v)
    metrics = trainer.step(batch)            # forward/backward per micro-batch, clip, optimizer step

`accumulate` runs forward + backward without stepping (the equivalence tests compare its gradients).
With ``dist`` (clawpipe.train.distributed) the trainer is one rank of a sharded step: the policy is
FSDP2-sharded, the rank packs only its share of the batch's trees, and the loss parts are batch totals.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from clawpipe.errors import ConfigError
from clawpipe.train import advantages as adv_mod
from clawpipe.train.batch import TrainBatch
from clawpipe.train.config import TrainConfig
from clawpipe.train.losses import Scores, TermInputs, attention_for, contribution_loss, score
from clawpipe.train.packing import MicroBatch, pack_flat, pack_trees

if TYPE_CHECKING:
    from clawpipe.train.distributed import DistContext

log = logging.getLogger(__name__)

MAX_PARTS = ("ratio_max", "logprob/max_abs_diff_current")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def disable_dropout(model: torch.nn.Module) -> None:
    """Zero every dropout of the policy (its Dropout modules and the attention dropout rates transformers reads
    in training mode). The policy must score tokens as the engine did when it sampled them: with dropout (GPT-2's
    configs default to 0.1) every ratio to the sampling logprobs, and the step's own first-epoch ratio, would be
    noise away from 1, and clipping would act on that noise. Training mode itself stays (checkpointing needs it)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            setattr(module, "attention_dropout", 0.0)  # noqa: B010 (a float attribute of the attention module)


def enable_activation_checkpointing(model: Any) -> None:
    """Checkpoint every decoder layer (non-reentrant: it passes the tree attention's plan argument through)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; older: the previous name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@dataclass
class StepState:
    """What one training step computes before its epochs, per contribution (a (token, sequence) pair):
    the proximal logprobs (filled by the first epoch's forward), and, where the algorithm needs them, the
    frozen reference's logprobs (KL), the pre-step values, advantages and returns (PPO)."""

    prox: np.ndarray  # (C,) float32
    ref: np.ndarray | None = None  # (C,) reference policy logprobs
    v_old: np.ndarray | None = None  # (C,) pre-step values
    adv: np.ndarray | None = None  # (C,) PPO advantages (GRPO keeps the batch's own)
    returns: np.ndarray | None = None  # (C,) PPO returns


class Trainer:
    """Holds the policy (+ value head for PPO), the optimizer and an optional frozen reference policy."""

    def __init__(
        self,
        model: Any,
        config: TrainConfig,
        *,
        policy_version: int = 0,
        value_head: torch.nn.Module | None = None,
        reference: torch.nn.Module | None = None,
        optimizer_state: dict | None = None,
        dist: DistContext | None = None,
    ) -> None:
        self.config = config
        self.dist = dist
        self.device = dist.device if dist is not None else resolve_device(config.device)
        if self.device.type == "cpu":
            from clawpipe.config import get_settings

            torch.set_num_threads(get_settings().torch_threads)
        torch.manual_seed(config.seed)
        self.model = model.to(self.device)
        self.model.train()
        disable_dropout(self.model)
        if config.activation_checkpointing:
            enable_activation_checkpointing(self.model)
        self.policy_version = policy_version
        if config.algorithm == "ppo" and value_head is None:
            value_head = torch.nn.Linear(model.config.hidden_size, 1)
            torch.nn.init.zeros_(value_head.weight)
            torch.nn.init.zeros_(value_head.bias)
        self.value_head = value_head.to(self.device) if value_head is not None else None
        self.reference = reference.to(self.device).eval() if reference is not None else None
        if config.kl_coef > 0 and self.reference is None:
            raise ConfigError("kl_coef > 0 needs a reference model: pass reference= (or set kl_coef = 0)")
        self.scorer: torch.nn.Module | None = None
        if dist is not None:
            from clawpipe.train import distributed

            self.scorer = distributed.Scorer(self.model, self.value_head)
            distributed.shard(self.scorer, dist)
            self.params = [p for p in self.scorer.parameters() if p.requires_grad]
        else:
            self.params = [p for p in self.model.parameters() if p.requires_grad]
            if self.value_head is not None:
                self.params += list(self.value_head.parameters())
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.learning_rate, betas=config.betas, weight_decay=config.weight_decay
        )
        if optimizer_state is not None:
            try:
                self.optimizer.load_state_dict(optimizer_state)
            except (ValueError, KeyError) as exc:
                log.warning("optimizer state does not match the parameters (%s); starting a fresh optimizer", exc)

    # ---------------------------------------------------------------------------------------------------
    def pack(self, batch: TrainBatch, layout: str = "tree") -> list[MicroBatch]:
        cfg = self.config
        budget = cfg.max_tokens_per_micro_batch
        share = self.share(batch)
        if layout == "tree":
            mbs = pack_trees(batch, budget, attention=cfg.attention, block=cfg.attention_block_tokens, trees=share)
        elif share is not None:
            raise ConfigError("distributed training packs trees: use the tree layout")
        else:
            mbs = pack_flat(batch, budget)
        over = [mb.n_tokens for mb in mbs if mb.n_tokens > budget]
        if over:
            log.info(
                "%d micro-batch(es) above max_tokens_per_micro_batch = %d for paths longer than it (longest %d tokens)",
                len(over),
                budget,
                max(over),
            )
        mbs = [mb.to(self.device) for mb in mbs]
        if self.dist is not None:  # every rank runs as many forwards as the busiest one (FSDP gathers in each)
            from clawpipe.train.distributed import max_int, padding_micro_batch

            most = max_int(len(mbs), self.dist)
            mbs += [padding_micro_batch(self.device) for _ in range(most - len(mbs))]
        return mbs

    def share(self, batch: TrainBatch) -> set[int] | None:
        """This rank's trees (None: all, single process)."""
        if self.dist is None:
            return None
        from clawpipe.train.distributed import assign_trees

        return set(assign_trees([t.n_tokens for t in batch.trees], self.dist.world)[self.dist.rank])

    def _autocast(self) -> torch.autocast:
        enabled = self.device.type == "cuda" and self.config.bf16
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def _score(self, model: Any, mb: MicroBatch, value_head: torch.nn.Module | None = None):
        with self._autocast():
            if self.scorer is not None and model is self.model:
                lp, ent, value = self.scorer(
                    mb, self.config.sampling_temperature, self.config.entropy_coef > 0, value_head is not None
                )
                return Scores(lp, ent, value)
            return score(
                model,
                mb,
                temperature=self.config.sampling_temperature,
                value_head=value_head,
                entropy_grad=self.config.entropy_coef > 0,
            )

    @torch.no_grad()
    def _prepass(self, batch: TrainBatch, mbs: list[MicroBatch], out: StepState) -> None:
        """Reference logprobs (KL) and pre-step values (PPO) per contribution, without gradients."""
        c = batch.contrib
        if self.reference is not None:
            ref = np.zeros(len(c), dtype=np.float32)
            for mb in mbs:
                if not len(mb.contrib_index):  # padding: the replicated reference needs no collective
                    continue
                s = self._score(self.reference, mb)
                ref[mb.contrib_index] = s.logprob[mb.contrib_score].float().cpu().numpy()
            out.ref = ref
        if self.value_head is not None:
            v = np.zeros(len(c), dtype=np.float32)
            for mb in mbs:
                s = self._score(self.model, mb, self.value_head)
                assert s.value is not None
                v[mb.contrib_index] = s.value[mb.contrib_score].float().cpu().numpy()
            if self.dist is not None:  # whitening and GAE see every contribution's value
                from clawpipe.train.distributed import all_reduce_array

                v = all_reduce_array(v, self.dist)
            out.v_old = v

    def _rank_totals(self, metrics: dict[str, float]) -> dict[str, float]:
        """Forward tokens over all ranks, the busiest rank's share, and the world size."""
        from clawpipe.train.distributed import all_reduce_array

        assert self.dist is not None
        mine = metrics["tokens/forward"]
        total = float(all_reduce_array(np.asarray([mine]), self.dist)[0])
        busiest = float(all_reduce_array(np.asarray([mine]), self.dist, "max")[0])
        return {
            "tokens/forward": total,
            "dist/world_size": float(self.dist.world),
            "dist/forward_tokens_busiest_rank": busiest,
            "dist/balance": total / (busiest * self.dist.world) if busiest else 1.0,
        }

    def ppo_advantages(self, batch: TrainBatch, v_old: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """GAE per contribution (whitened if configured) and value targets."""
        c = batch.contrib
        cfg = self.config
        rewards = {i.rollout_id: float(i.reward) for i in batch.rollouts}
        adv = np.zeros(len(c), dtype=np.float64)
        for ti, tree in enumerate(batch.trees):
            sel = np.flatnonzero(c.tree == ti)
            values = np.zeros(tree.n_tokens, dtype=np.float64)
            values[c.pos[sel]] = v_old[sel]
            scored = np.zeros(tree.n_tokens, dtype=bool)
            scored[c.pos[sel]] = True
            token_adv = adv_mod.gae_token_advantages(tree, rewards, values, scored, gamma=cfg.gamma, lam=cfg.gae_lambda)
            adv[sel] = token_adv[c.pos[sel]]
        returns = adv + v_old
        if cfg.whiten_advantages and len(adv) > 1:
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        return adv.astype(np.float32), returns.astype(np.float32)

    # ---------------------------------------------------------------------------------------------------
    def accumulate(
        self, batch: TrainBatch, mbs: list[MicroBatch], *, epoch: int = 0, state: StepState | None = None
    ) -> dict[str, float]:
        """Forward + backward over all micro-batches (gradients accumulate); returns summed loss parts."""
        state = state if state is not None else self.prepare(batch, mbs)
        sums: dict[str, float] = defaultdict(float)
        for mb in mbs:
            with attention_for(self.model, mb):  # checkpointed layers re-run their attention in backward
                parts = self._accumulate_one(batch, mb, epoch, state)
            for k, v in parts.items():
                if k in MAX_PARTS:
                    sums[k] = max(sums[k], v)
                else:
                    sums[k] += v
        if self.dist is not None:
            from clawpipe.train.distributed import merge_sums

            return merge_sums(dict(sums), self.dist, MAX_PARTS)
        return dict(sums)

    def _accumulate_one(self, batch: TrainBatch, mb: MicroBatch, epoch: int, state: StepState) -> dict[str, float]:
        """Forward + backward of one micro-batch; its loss parts (and logprob drift on the first epoch)."""
        c = batch.contrib
        idx = mb.contrib_index
        out: dict[str, float] = {}
        s = self._score(self.model, mb, self.value_head)
        if not len(idx):  # a padding micro-batch: zero loss, but every parameter takes part in the backward
            zero = s.logprob.sum() * 0.0
            (zero + s.value.sum() * 0.0 if s.value is not None else zero).backward()
            return out
        lp = s.logprob[mb.contrib_score]  # (C_mb,)
        if epoch == 0:
            state.prox[idx] = lp.detach().float().cpu().numpy()
            current = ~c.stale[idx]
            if current.any():
                diff = np.abs(state.prox[idx][current] - c.old_logprob[idx][current])
                out["logprob/max_abs_diff_current"] = float(diff.max())
                out["_diff_sum"] = float(diff.sum())
                out["_diff_n"] = float(current.sum())

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a[idx])).to(self.device)

        x = TermInputs(
            logprob=lp,
            old_logprob=t(c.old_logprob),
            prox_logprob=t(state.prox),
            stale=t(c.stale),
            adv=t(state.adv if state.adv is not None else c.adv).float(),
            coef=t(c.coef).float(),
            entropy=s.entropy[mb.contrib_score],
            ref_logprob=t(state.ref) if state.ref is not None else None,
            value=s.value[mb.contrib_score] if s.value is not None else None,
            v_old=t(state.v_old) if state.v_old is not None else None,
            returns=t(state.returns) if state.returns is not None else None,
        )
        loss, parts = contribution_loss(x, self.config)
        loss.backward()
        out.update({k: float(v) for k, v in parts.items()})
        return out

    def prepare(self, batch: TrainBatch, mbs: list[MicroBatch]) -> StepState:
        """Per-step state: proximal logprobs slot, reference logprobs, PPO values/advantages/returns."""
        state = StepState(prox=np.zeros(len(batch.contrib), dtype=np.float32))
        if self.reference is not None or self.value_head is not None:
            self._prepass(batch, mbs, state)
        if self.config.algorithm == "ppo":
            assert state.v_old is not None  # PPO always has a value head
            state.adv, state.returns = self.ppo_advantages(batch, state.v_old)
        return state

    def step(self, batch: TrainBatch, *, layout: str = "tree") -> dict[str, float]:
        """One training step (config.epochs optimizer steps over the batch); returns metrics."""
        t0 = time.perf_counter()
        metrics: dict[str, float] = {k: float(v) for k, v in batch.stats.items()}
        c = batch.contrib
        metrics.update(
            {
                "tokens/flattened": float(batch.flattened_tokens),
                "tokens/unique": float(batch.unique_tokens),
                "tokens/redundancy": batch.flattened_tokens / max(batch.unique_tokens, 1),
                "tokens/trained": float(len(c)),
            }
        )
        if len(c) == 0:
            st = batch.stats
            log.warning(
                "empty batch, no update this step: of %d group(s), %d zero-variance (%d of one rollout), %d "
                "without a usable reward; %d empty completion(s)",
                int(st.get("groups", 0)),
                int(st.get("groups_skipped_zero_variance", 0)),
                int(st.get("groups_single_rollout", 0)),
                int(st.get("groups_skipped_no_reward", 0) + st.get("groups_skipped_reward_range", 0)),
                int(st.get("sequences_no_generated_tokens", 0)),
            )
            metrics["empty_step"] = 1.0
            return metrics
        mbs = self.pack(batch, layout)
        metrics["micro_batches"] = float(len(mbs))
        metrics["tokens/forward"] = float(sum(mb.n_tokens for mb in mbs))
        metrics["tokens/largest_micro_batch"] = float(max(mb.n_tokens for mb in mbs))
        if self.dist is not None:
            metrics.update(self._rank_totals(metrics))
        state = self.prepare(batch, mbs)
        if state.adv is not None:
            metrics["advantage/mean"] = float(np.mean(state.adv))
        else:
            metrics["advantage/mean"] = float(np.mean(c.adv))
            metrics["advantage/abs_mean"] = float(np.mean(np.abs(c.adv)))
        for epoch in range(self.config.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            sums = self.accumulate(batch, mbs, epoch=epoch, state=state)
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
            grad_norm = float(norm) if self.dist is None else _full_norm(norm)
            if not math.isfinite(grad_norm):
                raise FloatingPointError(f"non-finite gradient norm {grad_norm}; lower learning_rate")
            self.optimizer.step()
            if epoch == 0:
                first = dict(sums)
                first["grad_norm"] = grad_norm
        self.optimizer.zero_grad(set_to_none=True)
        n_diff = first.pop("_diff_n", 0.0)
        diff_sum = first.pop("_diff_sum", 0.0)
        if n_diff:
            first["logprob/mean_abs_diff_current"] = diff_sum / n_diff
        first["clip_fraction"] = first.pop("clip_count", 0.0) / len(c)
        if "value_clip_count" in first:
            first["value_clip_fraction"] = first.pop("value_clip_count") / len(c)
        metrics.update(first)
        if self.device.type == "cuda":
            metrics["memory/peak_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        elapsed = time.perf_counter() - t0
        metrics["time/step_s"] = elapsed
        metrics["throughput/flattened_tokens_per_s"] = batch.flattened_tokens / elapsed
        metrics["throughput/forward_tokens_per_s"] = metrics["tokens/forward"] / elapsed
        return metrics


def _full_norm(norm: torch.Tensor) -> float:
    from clawpipe.train.distributed import full_norm

    return full_norm(norm)
