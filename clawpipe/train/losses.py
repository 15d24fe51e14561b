"""Scoring a micro-batch (current logprobs, entropy, values) and the per-contribution loss terms.

Every term is computed per contribution (generated token x sequence), so sequences sharing a token keep
their own ratio, advantage and clipping; the loss is sum(coef * term) with the batch's aggregation
coefficients (clawpipe.train.batch).

- Policy: clipped surrogate (PPO, Schulman et al. 2017) with the ratio against the captured sampling
  logprob. Calls sampled by an older policy_version use the decoupled form: ratio against the policy at the
  step start (proximal), times the truncated importance weight min(pi_prox / pi_behaviour, tis_cap).
- Entropy bonus: -entropy_coef * H(pi(.|prefix)).
- KL to the reference: k3 estimator exp(ref - lp) - (ref - lp) - 1 (Schulman 2020, "Approximating KL").
- PPO value loss: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-value_clip) - R)^2).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from clawpipe.train.attention import PLAN_KWARG, tree_attention
from clawpipe.train.config import TrainConfig
from clawpipe.train.packing import MicroBatch


@dataclass
class Scores:
    """Per scored token of a micro-batch."""

    logprob: torch.Tensor  # (S,) float32
    entropy: torch.Tensor  # (S,) float32 (detached unless the entropy bonus is on)
    value: torch.Tensor | None  # (S,) float32, PPO only


def decoder_of(model: Any) -> Any:
    """The transformer body (without the LM head) of a causal LM."""
    prefix = getattr(model, "base_model_prefix", "model")
    return getattr(model, prefix, None) or model.get_decoder()


def attention_mask_for(model: Any, mb: MicroBatch) -> torch.Tensor | None:
    """Bool 4D masks for sdpa; additive float masks for eager (a bool mask with eager is silently wrong)."""
    mask = mb.attention_mask
    if mask is not None and mask.dim() == 4 and getattr(model.config, "_attn_implementation", "sdpa") == "eager":
        dtype = next(model.parameters()).dtype
        zero = torch.zeros((), dtype=dtype, device=mask.device)
        return torch.where(mask, zero, torch.finfo(dtype).min)
    return mask


def attention_for(model: Any, mb: MicroBatch) -> contextlib.AbstractContextManager[None]:
    """The attention a micro-batch needs for its forward AND backward (checkpointed layers re-run there)."""
    return tree_attention(model) if mb.tree is not None else contextlib.nullcontext()


def score(
    model: Any,
    mb: MicroBatch,
    *,
    temperature: float,
    value_head: torch.nn.Module | None = None,
    entropy_grad: bool = False,
) -> Scores:
    """Forward the micro-batch; logits (and values) only at the hidden states that predict scored tokens."""
    decoder = decoder_of(model)
    if mb.tree is not None:
        with tree_attention(model):
            # no mask: the plan goes to the kernel as a keyword every decoder passes on (a mask dict reached it only
            # in decoders that take one, such as Qwen2's; Llama's built a None mask of it, GPT-2's failed on it)
            plan = {PLAN_KWARG: mb.tree}
            out = decoder(
                input_ids=mb.input_ids, attention_mask=None, position_ids=mb.position_ids, use_cache=False, **plan
            )
    else:
        out = decoder(
            input_ids=mb.input_ids,
            attention_mask=attention_mask_for(model, mb),
            position_ids=mb.position_ids,
            use_cache=False,
        )
    hidden = out.last_hidden_state  # (B, L, H)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, mb.score_rows)  # (S, H)
    logits = model.get_output_embeddings()(h).float() / temperature  # (S, V)
    logp = F.log_softmax(logits, dim=-1)
    lp = logp.gather(1, mb.score_targets[:, None]).squeeze(1)  # (S,)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp.exp() * logp).sum(-1)  # (S,)
    value = value_head(h.float()).squeeze(-1) if value_head is not None else None
    return Scores(lp, entropy, value)


@dataclass
class TermInputs:
    """Per-contribution inputs of one micro-batch (float32 tensors of length C_mb)."""

    logprob: torch.Tensor  # current logprob (with grad)
    old_logprob: torch.Tensor  # captured sampling logprob
    prox_logprob: torch.Tensor  # policy at step start (detached); used for stale contributions
    stale: torch.Tensor  # bool
    adv: torch.Tensor
    coef: torch.Tensor
    entropy: torch.Tensor
    ref_logprob: torch.Tensor | None = None
    value: torch.Tensor | None = None
    v_old: torch.Tensor | None = None
    returns: torch.Tensor | None = None


def contribution_loss(x: TermInputs, cfg: TrainConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """sum(coef * per-contribution loss) and its detached parts (already aggregated with coef)."""
    base = torch.where(x.stale, x.prox_logprob, x.old_logprob)
    ratio = torch.exp(x.logprob - base)  # (C,)
    tis = torch.where(x.stale, torch.exp(x.prox_logprob - x.old_logprob).clamp(max=cfg.tis_cap), 1.0)
    surr1 = ratio * x.adv
    surr2 = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * x.adv
    pg = -tis * torch.minimum(surr1, surr2)  # (C,)
    total = (x.coef * pg).sum()
    parts = {
        "loss/policy": (x.coef * pg).sum().detach(),
        "entropy": (x.coef * x.entropy).sum().detach(),
        "clip_count": (surr2 < surr1).sum().detach().float(),
        "ratio_max": ratio.max().detach() if len(ratio) else ratio.new_zeros(()),
    }
    if cfg.entropy_coef > 0:
        ent = -(cfg.entropy_coef * (x.coef * x.entropy).sum())
        total = total + ent
        parts["loss/entropy"] = ent.detach()
    if x.ref_logprob is not None:
        d = x.ref_logprob - x.logprob
        kl = torch.exp(d) - d - 1.0  # (C,) k3
        kl_term = (x.coef * kl).sum()
        total = total + cfg.kl_coef * kl_term
        parts["kl"] = kl_term.detach()
        parts["loss/kl"] = (cfg.kl_coef * kl_term).detach()
    if x.value is not None and x.v_old is not None and x.returns is not None:
        v_clip = x.v_old + (x.value - x.v_old).clamp(-cfg.value_clip, cfg.value_clip)
        vf = 0.5 * torch.maximum((x.value - x.returns) ** 2, (v_clip - x.returns) ** 2)  # (C,)
        vf_term = (x.coef * vf).sum()
        total = total + cfg.value_coef * vf_term
        parts["loss/value"] = vf_term.detach()
        parts["value_clip_count"] = ((v_clip - x.returns) ** 2 > (x.value - x.returns) ** 2).sum().detach().float()
    parts["loss/total"] = total.detach()
    return total, parts
