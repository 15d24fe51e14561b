"""The running batch's KV: per layer, (B, H, L, D) keys and values in buffers with room for the rows' coming
tokens, and the (B, L) mask of real (not left-padding) positions. Rows join (left-padded to a common length)
and leave (with the columns that became padding in every row) between decode steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from clawpipe.serving.hf_cache import KV, GrowingLayer, cache_of

if TYPE_CHECKING:
    from transformers import DynamicCache


class BatchKV:
    """KV buffers and padding mask of the rows being decoded together (row order is the engine's)."""

    def __init__(self) -> None:
        self.layers: list[GrowingLayer] = []
        self.mask: torch.Tensor | None = None  # (B, L) 1 = real token

    def clear(self) -> None:
        self.layers, self.mask = [], None

    def views(self) -> list[KV]:
        """The (B, H, L, D) keys and values of the batch, per layer (views, no copy)."""
        return [layer.view() for layer in self.layers]

    def hold(self, layers: list[KV], room: int, limit: int) -> None:
        """Keep these batch KV tensors in buffers with `room` more positions, so that a decode step writes its
        new position in place (the default cache concatenates: a copy of all KV per step). The room stops at
        `limit` (the longest row reservation), so the KV budget still bounds the memory."""
        length = layers[0][0].shape[2]
        cap = max(length + 1, min(length + room, limit))
        self.layers = [GrowingLayer(k, v, cap) for k, v in layers]

    def add(self, layers: list[KV], mask: torch.Tensor, room: int, limit: int) -> None:
        """Append rows (their prefilled KV and mask), left-padding the shorter side to a common length."""
        if self.mask is None:
            self.mask = mask
            self.hold(layers, room, limit)
            return
        old_len, new_len = self.mask.shape[1], mask.shape[1]
        pad_old, pad_new = max(0, new_len - old_len), max(0, old_len - new_len)
        merged = []
        for (ko, vo), (kn, vn) in zip(self.views(), layers, strict=True):
            ko, vo = left_pad(ko, pad_old), left_pad(vo, pad_old)
            kn, vn = left_pad(kn, pad_new), left_pad(vn, pad_new)
            merged.append((torch.cat([ko, kn], 0), torch.cat([vo, vn], 0)))
        self.mask = torch.cat(
            [torch.nn.functional.pad(self.mask, (pad_old, 0)), torch.nn.functional.pad(mask, (pad_new, 0))], 0
        )
        self.hold(merged, room, limit)

    def keep(self, rows: list[int], room: int, limit: int) -> None:
        """Keep only these rows (indices, in order), dropping leading columns that are padding in all of them."""
        assert self.mask is not None
        idx = torch.tensor(rows, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        first = int(mask.any(0).nonzero()[0, 0])
        self.mask = mask[:, first:]
        self.hold(
            [(k.index_select(0, idx)[:, :, first:], v.index_select(0, idx)[:, :, first:]) for k, v in self.views()],
            room,
            limit,
        )

    def step(self) -> tuple[torch.Tensor, torch.Tensor, DynamicCache]:
        """Inputs of one decode step: (positions (B, 1), mask with the new column (B, L+1), cache); the mask is
        the batch's from now on (the forward pass writes the new position into the buffers)."""
        assert self.mask is not None
        positions = self.mask.sum(dim=1, keepdim=True)  # real tokens before this one
        ones = torch.ones((self.mask.shape[0], 1), dtype=self.mask.dtype, device=self.mask.device)
        self.mask = torch.cat([self.mask, ones], 1)
        return positions, self.mask, cache_of(self.layers)


def left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    """Pad a (B, H, L, D) cache tensor with n zero positions on the left of L."""
    if n == 0:
        return t
    return torch.nn.functional.pad(t, (0, 0, n, 0))
