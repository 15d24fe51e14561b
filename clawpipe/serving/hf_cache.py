"""The only code that touches transformers' cache internals (DynamicCache, DynamicLayer): a cache layer that
writes new positions into a buffer with room instead of concatenating, and wrappers between a DynamicCache and
plain per-layer (keys, values) tensors. A transformers upgrade that changes the cache classes changes this file.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

KV = tuple[torch.Tensor, torch.Tensor]  # (B, H, L, D) keys and values of one layer


class GrowingLayer(DynamicLayer):
    """A cache layer whose keys/values are views into buffers with spare positions: `update` writes the new
    positions in place and returns longer views, instead of concatenating a copy of the whole cache."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        super().__init__()
        b, h, n, d = keys.shape
        self.device = keys.device
        self._k = keys.new_empty((b, h, max(capacity, n), d))
        self._v = values.new_empty((b, h, max(capacity, n), values.shape[3]))
        self._k[:, :, :n], self._v[:, :, :n] = keys, values
        self.length = n
        self.keys, self.values = self.view()
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + key_states.shape[-2]
        if end > self._k.shape[2]:  # past the reservation (a row outliving the longest one): grow a little
            more = end + 64 - self._k.shape[2]
            self._k = torch.nn.functional.pad(self._k, (0, 0, 0, more))
            self._v = torch.nn.functional.pad(self._v, (0, 0, 0, more))
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self.view()
        return self.keys, self.values

    def view(self) -> KV:
        """The (B, H, L, D) keys and values held now."""
        return self._k[:, :, : self.length], self._v[:, :, : self.length]


def empty_cache() -> DynamicCache:
    """A fresh cache for a forward pass without earlier positions."""
    return DynamicCache()


def cache_of(layers: list[GrowingLayer]) -> DynamicCache:
    """A DynamicCache over these layers (updated in place by the forward pass)."""
    cache = DynamicCache(ddp_cache_data=[(None, None)] * len(layers))
    cache.layers = list(layers)
    return cache


def layers_of(cache: Any) -> list[KV]:
    """The (B, H, L, D) key/value tensors of each layer of a DynamicCache."""
    return [(layer.keys, layer.values) for layer in cache.layers]
