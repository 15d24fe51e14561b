"""Tree attention over a packed row in memory linear in its length: causal kernels on segments, no N x N mask.

A packed row (trees laid out parent-first, each branch contiguous: clawpipe.train.packing) is cut into
segments: maximal runs in which every token's parent is the token just before it. Token j of a segment
sees exactly the segment's context (the ancestors of its first token: a few row ranges) and the segment up
to j. So:

- A segment without context (a tree's trunk; a micro-batch that is one chain is a single such segment)
  runs scaled_dot_product_attention with ``is_causal`` on row slices. The fused kernel (flash on CPU and
  CUDA) keeps neither a mask nor a score matrix, so memory grows linearly with the segment's length.
- A segment with context (a later branch) gathers its keys and values once (context ranges, then itself)
  and runs its queries in blocks of ``block``: each block sees every context key and the segment causally
  up to its own last query. That bottom-right causal mask is a column slice of one shared
  ``[block, max keys]`` additive mask, a view rather than a copy per block.

Attention work is the sum over tokens of the keys each one sees (what the flat computation spends per
unique token); memory is the row's q/k/v, one gathered context per branching segment and a
``block x longest keys`` mask, never ``n x n``.

Why not flex attention with a block mask: with torch 2.13 its backward raises NotImplementedError on CPU
("FlexAttention does not support backward on CPU"), so it cannot train here.

Used through transformers' attention registry: the model's config switches to ``clawpipe_tree`` for the
packed forward (and its backward, where activation checkpointing recomputes layers), and the decoder
receives no mask and the plan as the keyword ``PLAN_KWARG``, which every transformers decoder passes on to its
attention function untouched. (A mask dict ``{"full_attention": plan}`` reaches the layers only in decoders that
take one, such as Qwen2's; Llama's builds its own mask from it, which is None for a kernel without a mask
function, and GPT-2's fails on it.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from clawpipe.errors import TrainingError

NAME = "clawpipe_tree"
PLAN_KWARG = "clawpipe_tree_plan"  # the keyword the packed forward hands its TreeAttention to the kernel with


@dataclass
class Segment:
    """Rows [start, end) of a packed row, each the child of the one before; context = rows seen by all."""

    start: int
    end: int
    context: list[tuple[int, int]]  # row ranges [a, b) of the first token's ancestors, parent-first

    @property
    def context_len(self) -> int:
        return sum(b - a for a, b in self.context)


@dataclass
class TreeAttention:
    """How one packed row attends: its segments, the query block size and a cached shared mask."""

    n: int
    segments: list[Segment]
    block: int
    _masks: dict[tuple[torch.dtype, torch.device], torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def mask_width(self) -> int:
        """Keys seen by the widest query block of a segment with context (0 when there is none)."""
        return max((s.context_len + s.end - s.start for s in self.segments if s.context), default=0)

    @property
    def pairs(self) -> int:
        """Query x key pairs the kernels compute (the attention work; n^2 would be a dense mask's)."""
        total = 0
        for s in self.segments:
            m, c = s.end - s.start, s.context_len
            total += m * c + m * (m + 1) // 2
        return total

    def mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Additive [block, W] mask: row i sees columns <= W - block + i (bottom-right causal)."""
        key = (dtype, device)
        if key not in self._masks:
            w = self.mask_width
            rows = torch.arange(self.block, device=device)[:, None]
            cols = torch.arange(w, device=device)[None, :]
            hidden = cols > (w - self.block + rows)
            self._masks[key] = torch.zeros((self.block, w), dtype=dtype, device=device).masked_fill_(
                hidden, float("-inf")
            )
        return self._masks[key]


def build_plan(parent: np.ndarray, block: int) -> TreeAttention:
    """Segments of a packed row from each row's parent row (-1 for a root); parents come first."""
    n = len(parent)
    if n == 0:
        return TreeAttention(0, [], block)
    is_start = parent != np.arange(n) - 1
    is_start[0] = True
    starts = np.flatnonzero(is_start).tolist()
    ends = [*starts[1:], n]
    seg_of = np.cumsum(is_start) - 1
    segments: list[Segment] = []
    for a, b in zip(starts, ends, strict=True):
        p = int(parent[a])
        if p < 0:
            segments.append(Segment(a, b, []))
            continue
        up = segments[int(seg_of[p])]
        context = list(up.context)
        if context and context[-1][1] == up.start:  # adjacent ranges merge into one slice
            context[-1] = (context[-1][0], p + 1)
        else:
            context.append((up.start, p + 1))
        segments.append(Segment(a, b, context))
    return TreeAttention(n, segments, block)


def dense_mask(parent: np.ndarray) -> np.ndarray:
    """The (n, n) bool ancestor mask of a packed row (the ``attention = "dense"`` reference path)."""
    n = len(parent)
    allowed = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parent.tolist()):  # row i = row of its parent + itself (parents come first)
        if p >= 0:
            allowed[i] = allowed[p]
        allowed[i, i] = True
    return allowed


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, H, N, D)
    key: torch.Tensor,  # (1, H_kv, N, D)
    value: torch.Tensor,  # (1, H_kv, N, D)
    attention_mask: TreeAttention | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    plan = kwargs.get(PLAN_KWARG, attention_mask)
    if not isinstance(plan, TreeAttention):  # a decoder that drops keywords: fail loudly, never attend wrongly
        raise TrainingError(
            f"the tree attention kernel got no plan (a {type(plan).__name__}): this model's decoder does not pass "
            f"'{PLAN_KWARG}' on to attention; train it with attention = 'dense'"
        )
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for seg in plan.segments:
        a, b = seg.start, seg.end
        q = query[:, :, a:b]
        if not seg.context:
            outs.append(
                F.scaled_dot_product_attention(
                    q,
                    key[:, :, a:b],
                    value[:, :, a:b],
                    is_causal=True,
                    dropout_p=dropout,
                    scale=scaling,
                    enable_gqa=gqa,
                )
            )
            continue
        # one gathered copy per segment; the blocks below take prefix views of it
        k = torch.cat([key[:, :, s:e] for s, e in seg.context] + [key[:, :, a:b]], dim=2)
        v = torch.cat([value[:, :, s:e] for s, e in seg.context] + [value[:, :, a:b]], dim=2)
        mask = plan.mask(query.dtype, query.device)
        width = mask.shape[1]
        c = seg.context_len
        for off in range(0, b - a, plan.block):
            m = min(plan.block, b - a - off)
            kn = c + off + m  # keys the block's last query sees
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, off : off + m],
                    k[:, :, :kn],
                    v[:, :, :kn],
                    attn_mask=mask[plan.block - m :, width - kn :],
                    dropout_p=dropout,
                    scale=scaling,
                    enable_gqa=gqa,
                )
            )
    out = torch.cat(outs, dim=2)  # (1, H, N, D)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, tree_attention_forward)


@contextlib.contextmanager
def tree_attention(model: Any) -> Iterator[None]:
    """Switch the model's attention to the tree kernel while a packed forward (and backward) runs."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
