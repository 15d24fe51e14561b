"""Block-sparse tree attention: each block of queries attends only to the keys its tokens can see.

A packed tree row of n tokens needs, per token, its ancestors only; a dense n x n mask makes attention cost
n^2 whatever the tree. Here the row (laid out depth first, so a block is mostly one branch) is cut into
blocks of ``block`` consecutive queries; each block gathers the union of its tokens' ancestors as keys and
runs scaled_dot_product_attention with a small [block, keys] bool mask. Cost ~ sum over blocks of
block x (its depth + block): close to the flat computation's attention work per token, never n^2.

Used through transformers' attention registry: the model's config switches to ``clawpipe_tree`` for the
packed forward, and the decoder receives ``attention_mask={"full_attention": TreeBlocks}`` (a dict is
passed to the layers unchanged, skipping transformers' own mask building).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "clawpipe_tree"


@dataclass
class TreeBlocks:
    """Query blocks [start, end) of one packed row, each with its key positions and [q, k] bool mask."""

    starts: list[int]
    ends: list[int]
    keys: list[torch.Tensor]  # (K_b,) int64 key positions
    masks: list[torch.Tensor]  # (1, 1, Q_b, K_b) bool, True = may attend

    def to(self, device: torch.device) -> TreeBlocks:
        return TreeBlocks(self.starts, self.ends, [k.to(device) for k in self.keys], [m.to(device) for m in self.masks])

    @property
    def pairs(self) -> int:
        """Query x key pairs computed (the attention work)."""
        return int(sum(m.shape[-2] * m.shape[-1] for m in self.masks))


def build_blocks(allowed: np.ndarray, block: int) -> TreeBlocks:
    """Blocks of ``block`` queries from a dense (n, n) ancestor mask."""
    n = allowed.shape[0]
    starts, ends, keys, masks = [], [], [], []
    for a in range(0, n, block):
        b = min(a + block, n)
        rows = allowed[a:b]  # (Q, n)
        kv = np.flatnonzero(rows.any(axis=0))
        starts.append(a)
        ends.append(b)
        keys.append(torch.from_numpy(kv))
        masks.append(torch.from_numpy(np.ascontiguousarray(rows[:, kv]))[None, None])
    return TreeBlocks(starts, ends, keys, masks)


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, H, N, D)
    key: torch.Tensor,  # (1, H_kv, N, D)
    value: torch.Tensor,  # (1, H_kv, N, D)
    attention_mask: TreeBlocks,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    outs = []
    for a, b, kv, mask in zip(
        attention_mask.starts, attention_mask.ends, attention_mask.keys, attention_mask.masks, strict=True
    ):
        k = key.index_select(2, kv)  # (1, H_kv, K_b, D)
        v = value.index_select(2, kv)
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, a:b], k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa
            )
        )  # (1, H, Q_b, D)
    out = torch.cat(outs, dim=2)  # (1, H, N, D)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, tree_attention_forward)


@contextlib.contextmanager
def tree_attention(model: Any) -> Iterator[None]:
    """Switch the model's attention to the block-sparse tree kernel for the duration of a forward."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
