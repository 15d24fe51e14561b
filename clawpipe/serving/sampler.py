"""Token sampling for a batch of rows: softmax(raw_logits / T) with top-p, one uniform draw per row, and the
logprob the trainer scores, log_softmax(raw_logits / T) of the sampled token (T below GREEDY_BELOW, 0 included:
argmax, scored under T = 1).

A row may shape the distribution it samples from (`Shaping`: penalties, ids it may not sample yet, top-k,
min-p), as top-p does; the logprob reported stays the policy's own, as vLLM reports it by default.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
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


@dataclass
class Shaping:
    """How one row's sampling distribution differs from the policy's (every field neutral by default).

    Penalties as OpenAI and vLLM define them: presence and frequency subtract from the logit of each id
    generated so far (once, and once per occurrence); repetition divides a positive logit of an id seen in the
    prompt or the output by it, and multiplies a negative one. `banned` ids get no probability (EOS before
    min_tokens), and every id but `force` when it is set; top_k keeps the k most likely ids, min_p those at least
    min_p times as likely as the likeliest."""

    counts: Mapping[int, int] | None = None  # generated ids -> occurrences
    seen: Collection[int] | None = None  # prompt and generated ids
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    banned: Collection[int] | None = None
    top_k: int = 0
    min_p: float = 0.0
    force: int | None = None  # the one id that may be sampled now


def _shaped(logits: torch.Tensor, shapes: list[Shaping | None]) -> torch.Tensor:
    """The logits each row samples from (a copy; the reported logprobs keep the raw ones)."""
    out = logits.clone()
    device = logits.device
    for r, sh in enumerate(shapes):
        if sh is None:
            continue
        row = out[r]
        if sh.repetition != 1.0 and sh.seen:
            idx = torch.tensor(sorted(sh.seen), device=device)
            v = row[idx]
            row[idx] = torch.where(v > 0, v / sh.repetition, v * sh.repetition)
        if (sh.presence or sh.frequency) and sh.counts:
            idx = torch.tensor(list(sh.counts), device=device)
            n = torch.tensor(list(sh.counts.values()), device=device, dtype=row.dtype)
            row[idx] -= sh.frequency * n + sh.presence
        if sh.force is not None:
            row.masked_fill_(torch.arange(row.shape[0], device=device) != sh.force, float("-inf"))
        if sh.banned:
            row[torch.tensor(sorted(sh.banned), device=device)] = float("-inf")
        if 0 < sh.top_k < row.shape[0]:
            kth = row.topk(sh.top_k).values[-1]
            row[row < kth] = float("-inf")
    return out


def sample(
    logits: torch.Tensor,
    temperatures: list[float],
    top_ps: list[float],
    draws: list[float],
    top_k: list[int],
    shapes: list[Shaping | None] | None = None,
) -> Sampled:
    """Sample one token per row of logits (B, V); each row's token depends only on its own draw and
    distribution, never on its batch neighbours: rows with top_p = 1 map the draw over the vocabulary in id
    order, top-p rows over the sorted nucleus. `top_k`: how many most likely ids to report per row."""
    logits = logits.float()
    temps = torch.tensor(temperatures, device=logits.device)
    greedy = temps < GREEDY_BELOW
    scale = torch.where(greedy, torch.ones_like(temps), temps)
    logp = torch.log_softmax(logits / scale[:, None], dim=-1)  # (B, V)
    probs = logp.exp()
    picked = logits
    if shapes is not None and any(sh is not None for sh in shapes):
        picked = _shaped(logits, shapes)
        probs = torch.softmax(picked / scale[:, None], dim=-1)
        for r, sh in enumerate(shapes):
            if sh is not None and sh.min_p > 0:
                probs[r] = torch.where(probs[r] >= sh.min_p * probs[r].max(), probs[r], 0.0)
    top_p = torch.tensor(top_ps, device=logits.device)
    u = torch.tensor(draws, device=logits.device, dtype=torch.float64)
    cum = probs.double().cumsum(-1)
    last = probs.shape[1] - 1
    # a draw of exactly 0 still lands on an id with probability (cum is flat over the ids shaped away)
    floor = torch.finfo(torch.float64).tiny
    sampled = torch.searchsorted(cum, (u * cum[:, -1]).clamp_min(floor)[:, None]).clamp_(max=last)[:, 0]
    nucleus = top_p < 1
    if bool(nucleus.any()):
        sorted_p, order = probs[nucleus].sort(dim=-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p[nucleus][:, None]
        sorted_cum = (sorted_p * keep).double().cumsum(-1)
        u_n = u[nucleus]
        pick = torch.searchsorted(sorted_cum, (u_n * sorted_cum[:, -1]).clamp_min(floor)[:, None]).clamp_(max=last)
        sampled[nucleus] = order.gather(1, pick)[:, 0]
    sampled = torch.where(greedy, picked.argmax(-1), sampled)
    chosen = logp.gather(1, sampled[:, None])[:, 0]
    tops: list[list[tuple[int, float]] | None] = [None] * len(draws)
    k = max(top_k)
    if k:
        top_lp, top_id = logp.topk(min(k, logp.shape[1]), dim=-1)
        pairs = [list(zip(i, v, strict=True)) for i, v in zip(top_id.tolist(), top_lp.tolist(), strict=True)]
        tops = [p[:n] or None for p, n in zip(pairs, top_k, strict=True)]
    return Sampled(sampled.tolist(), chosen.tolist(), tops)
