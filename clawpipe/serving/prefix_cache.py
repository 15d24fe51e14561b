"""KV of recent long prompts, reused by later prompts that share a prefix with one of them (a harness's next
turn extends its previous prompt; a task group shares its system prompt and tools)."""

from __future__ import annotations

import collections

import numpy as np
import torch

KV = tuple[torch.Tensor, torch.Tensor]


class PrefixCache:
    """KV of recent long prompts (LRU, bounded in tokens). A new prompt reuses the longest common prefix with a
    cached one: multi-turn harness calls extend their previous prompt, and a task group shares its system prompt
    and tools. Cleared on reload. Not counted in the KV budget (it bounds the batch), bounded by its own size."""

    MIN_TOKENS = 128

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: collections.OrderedDict[int, tuple[np.ndarray, list[tuple[torch.Tensor, torch.Tensor]]]] = (
            collections.OrderedDict()
        )
        self._next = 0
        self._tokens = 0

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0

    def lookup(self, prompt: list[int]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int] | None:
        """(cached layers, number of prompt tokens they cover) for the longest common prefix, or None."""
        if len(prompt) < self.MIN_TOKENS or not self._entries:
            return None
        ids = np.asarray(prompt, dtype=np.int64)
        best, best_key = 0, -1
        for key, (cached_ids, _) in self._entries.items():
            n = min(len(cached_ids), len(ids))
            diff = np.flatnonzero(cached_ids[:n] != ids[:n])
            common = int(diff[0]) if diff.size else n
            if common > best:
                best, best_key = common, key
        use = min(best, len(prompt) - 1)  # at least one token is computed: its logits start the completion
        if use < self.MIN_TOKENS:
            return None
        self._entries.move_to_end(best_key)
        return self._entries[best_key][1], use

    def store(self, prompt: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]], row: int) -> None:
        """Keep row `row` of these prefill layers (its last len(prompt) positions) for later prompts."""
        n = len(prompt)
        if n < self.MIN_TOKENS or n > self.max_tokens:
            return
        kept = [(k[row : row + 1, :, -n:].clone(), v[row : row + 1, :, -n:].clone()) for k, v in layers]
        self._entries[self._next] = (np.asarray(prompt, dtype=np.int64), kept)
        self._next += 1
        self._tokens += n
        while self._tokens > self.max_tokens and self._entries:
            _, (old_ids, _) = self._entries.popitem(last=False)
            self._tokens -= len(old_ids)
