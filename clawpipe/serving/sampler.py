"""Token sampling for a batch of rows: softmax(raw_logits / T) with top-p, one uniform draw per row, and the
logprob the trainer scores, log_softmax(raw_logits / T) of the sampled token (T below GREEDY_BELOW, 0 included:
argmax, scored under T = 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Temperatures below this decode greedily, as vLLM does: dividing float32 logits by a temperature near zero
# (1e-40 is a valid JSON number) overflows them to inf, and the distribution, the sampled id and its logprob to NaN.
GREEDY_BELOW = 1e-5


@dataclass
class Sampled:
    """Per row: the sampled id, its logprob, and (when asked for) the k most likely (id, logprob) pairs."""

    ids: list[int]
    logprobs: list[float]
    tops: list[list[tuple[int, float]] | None]


def sample(
    logits: torch.Tensor, temperatures: list[float], top_ps: list[float], draws: list[float], top_k: list[int]
) -> Sampled:
    """Sample one token per row of logits (B, V); each row's token depends only on its own draw and
    distribution, never on its batch neighbours: rows with top_p = 1 map the draw over the vocabulary in id
    order, top-p rows over the sorted nucleus."""
    logits = logits.float()
    temps = torch.tensor(temperatures, device=logits.device)
    greedy = temps < GREEDY_BELOW
    scale = torch.where(greedy, torch.ones_like(temps), temps)
    logp = torch.log_softmax(logits / scale[:, None], dim=-1)  # (B, V)
    probs = logp.exp()
    top_p = torch.tensor(top_ps, device=logits.device)
    u = torch.tensor(draws, device=logits.device, dtype=torch.float64)
    cum = probs.double().cumsum(-1)
    last = probs.shape[1] - 1
    sampled = torch.searchsorted(cum, (u * cum[:, -1])[:, None]).clamp_(max=last)[:, 0]
    nucleus = top_p < 1
    if bool(nucleus.any()):
        sorted_p, order = probs[nucleus].sort(dim=-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p[nucleus][:, None]
        sorted_cum = (sorted_p * keep).double().cumsum(-1)
        u_n = u[nucleus]
        pick = torch.searchsorted(sorted_cum, (u_n * sorted_cum[:, -1])[:, None]).clamp_(max=last)
        sampled[nucleus] = order.gather(1, pick)[:, 0]
    sampled = torch.where(greedy, logits.argmax(-1), sampled)
    chosen = logp.gather(1, sampled[:, None])[:, 0]
    tops: list[list[tuple[int, float]] | None] = [None] * len(draws)
    k = max(top_k)
    if k:
        top_lp, top_id = logp.topk(min(k, logp.shape[1]), dim=-1)
        pairs = [list(zip(i, v, strict=True)) for i, v in zip(top_id.tolist(), top_lp.tolist(), strict=True)]
        tops = [p[:n] or None for p, n in zip(pairs, top_k, strict=True)]
    return Sampled(sampled.tolist(), chosen.tolist(), tops)
