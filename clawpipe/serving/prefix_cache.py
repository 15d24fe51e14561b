"""KV of recent long prompts, reused by later prompts that share a prefix with one of them (a harness's next
turn extends its previous prompt; a task group shares its system prompt and tools).

Prompts are found by their blocks: each cached prompt is indexed under a chained hash of every whole block of
:data:`BLOCK` ids it starts with, so a lookup hashes its own prompt once, walks down to the deepest block some
cached prompt shares, and compares ids only past that block, with the few prompts that share it. (Comparing a
prompt with every cached one from the start cost the whole cache per lookup: a rollout of n turns caching each
turn compared n prompts of up to n turns each per turn.) A hash only proposes: ids are always compared.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

KV = tuple[torch.Tensor, torch.Tensor]
BLOCK = 64  # ids per indexed block; at most MIN_TOKENS, so a prompt sharing no whole block is never a hit


@dataclass
class _Entry:
    ids: np.ndarray
    layers: list[KV]
    blocks: list[int]  # chained hashes of the prompt's whole blocks


def _block_hashes(ids: np.ndarray) -> Iterator[int]:
    """The chained hash of each whole block of ids, in order: the k-th stands for ids[: (k + 1) * BLOCK]."""
    raw = ids.tobytes()
    step = BLOCK * ids.itemsize
    h = 0
    for at in range(0, (len(ids) // BLOCK) * step, step):
        h = hash((h, raw[at : at + step]))
        yield h


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class PrefixCache:
    """KV of recent long prompts (LRU, bounded in tokens). A new prompt reuses the longest common prefix with a
    cached one: multi-turn harness calls extend their previous prompt, and a task group shares its system prompt
    and tools. Cleared on reload. Not counted in the KV budget (it bounds the batch), bounded by its own size."""

    MIN_TOKENS = 128

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._holders: dict[int, set[int]] = {}  # block hash -> entries whose prompt starts with those blocks
        self._next = 0
        self._tokens = 0

    def clear(self) -> None:
        self._entries.clear()
        self._holders.clear()
        self._tokens = 0

    def lookup(self, prompt: list[int]) -> tuple[list[KV], int] | None:
        """(cached layers, number of prompt tokens they cover) for the longest common prefix, or None."""
        if len(prompt) < self.MIN_TOKENS or not self._entries:
            return None
        ids = np.asarray(prompt, dtype=np.int64)
        shared: set[int] | None = None
        depth = 0  # whole blocks shared with some cached prompt
        for h in _block_hashes(ids):
            holders = self._holders.get(h)
            if not holders:
                break
            shared, depth = holders, depth + 1
        if shared is None:
            return None
        # past the deepest shared block the candidates differ within one block (or where a prompt ends); the
        # earliest stored wins among equals
        start = depth * BLOCK
        best, best_key = -1, -1
        for key in sorted(shared):
            common = _common(self._entries[key].ids[start : start + BLOCK], ids[start : start + BLOCK])
            if common > best:
                best, best_key = common, key
        best = _common(self._entries[best_key].ids, ids)  # the hashes proposed it: its ids say how far it goes
        use = min(best, len(prompt) - 1)  # at least one token is computed: its logits start the completion
        if use < self.MIN_TOKENS:
            return None
        self._entries.move_to_end(best_key)
        return self._entries[best_key].layers, use

    def store(self, prompt: list[int], layers: list[KV], row: int) -> None:
        """Keep row `row` of these prefill layers (its last len(prompt) positions) for later prompts."""
        n = len(prompt)
        if n < self.MIN_TOKENS or n > self.max_tokens:
            return
        kept = [(k[row : row + 1, :, -n:].clone(), v[row : row + 1, :, -n:].clone()) for k, v in layers]
        ids = np.asarray(prompt, dtype=np.int64)
        key = self._next
        self._next += 1
        entry = _Entry(ids, kept, list(_block_hashes(ids)))
        self._entries[key] = entry
        for h in entry.blocks:
            self._holders.setdefault(h, set()).add(key)
        self._tokens += n
        while self._tokens > self.max_tokens and self._entries:
            old_key, old = self._entries.popitem(last=False)
            self._tokens -= len(old.ids)
            for h in old.blocks:
                holders = self._holders[h]
                holders.discard(old_key)
                if not holders:
                    del self._holders[h]
