"""Prompt prefill: admitted prompts -> their KV and the logits of their last position, ready to join the batch.

Short prompts without a cached prefix are prefilled at once, together when they have the same length (no
padding, no mask). A prompt sharing a long prefix with a cached one starts from that KV; it and long prompts
(more than `chunk_tokens` to compute) queue, and each engine step computes at most `chunk_tokens` of the queue,
oldest first, so that the running rows decode between the chunks of a long prompt instead of waiting for it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch

from clawpipe.serving.hf_cache import KV, GrowingLayer, cache_of, empty_cache, layers_of
from clawpipe.serving.params import Request
from clawpipe.serving.prefix_cache import PrefixCache

Prefilled = tuple[list[Request], list[KV], torch.Tensor]  # requests, their KV (one row each), last-position logits


@dataclass
class _Pending:
    """A prompt being prefilled across engine steps: the KV of prompt_ids[:done] (None before the first chunk)."""

    request: Request
    layers: list[GrowingLayer] | None = None
    done: int = 0


class Prefiller:
    """The prefill queue of one engine (used by its worker thread only)."""

    def __init__(self, prefix_cache: PrefixCache, chunk_tokens: int, stats: dict[str, int]) -> None:
        self.prefix_cache = prefix_cache
        self.chunk_tokens = max(1, chunk_tokens)
        self.stats = stats
        self._queue: collections.deque[_Pending] = collections.deque()

    def __len__(self) -> int:
        return len(self._queue)

    def requests(self) -> list[Request]:
        """The requests whose prompts are still being computed (admitted: they count in the budgets)."""
        return [p.request for p in self._queue]

    def clear(self) -> None:
        self._queue.clear()

    def start(self, model: Any, reqs: list[Request]) -> list[Prefilled]:
        """Prefill the short prompts of newly admitted requests now (grouped by length); queue the others."""
        groups: dict[int, list[Request]] = collections.defaultdict(list)
        for req in reqs:
            n = len(req.prompt_ids)
            hit = self.prefix_cache.lookup(req.prompt_ids)
            if hit is not None:
                cached, use = hit
                self.stats["prefix_hit_tokens"] += use
                self._queue.append(
                    _Pending(req, [GrowingLayer(k[:, :, :use], v[:, :, :use], n) for k, v in cached], use)
                )
            elif n > self.chunk_tokens:
                self._queue.append(_Pending(req))
            else:
                groups[n].append(req)
        done = []
        for group in groups.values():
            ids = torch.tensor([req.prompt_ids for req in group], device=model.device)  # (G, P)
            out = model(input_ids=ids, cache=empty_cache(), use_cache=True, logits_to_keep=1)
            layers = layers_of(out.cache)
            for g, req in enumerate(group):
                self.prefix_cache.store(req.prompt_ids, layers, g)
            done.append((group, layers, out.logits[:, -1, :]))
        return done

    def step(self, model: Any) -> list[Prefilled]:
        """Compute at most `chunk_tokens` prompt tokens of the queue, oldest first; returns the prompts that are
        complete. One chunk per step bounds how long running rows wait for their next token."""
        budget, done = self.chunk_tokens, []
        while self._queue and budget > 0:
            p = self._queue[0]
            if p.request.cancelled:
                self._queue.popleft()
                continue
            prompt = p.request.prompt_ids
            end = min(len(prompt), p.done + budget)
            logits = self._chunk(model, p, end)
            budget -= end - p.done
            p.done = end
            if end < len(prompt):
                break
            self._queue.popleft()
            assert p.layers is not None
            layers = [layer.view() for layer in p.layers]
            self.prefix_cache.store(prompt, layers, 0)
            done.append(([p.request], layers, logits))
        return done

    def _chunk(self, model: Any, p: _Pending, end: int) -> torch.Tensor:
        """Compute prompt[p.done:end] on top of the prefill's KV; returns the logits of its last position."""
        ids = torch.tensor([p.request.prompt_ids[p.done : end]], device=model.device)  # (1, c)
        self.stats["prefill_chunks"] += 1
        if p.layers is None:  # the first chunk: no KV yet, so no positions or mask to pass
            out = model(input_ids=ids, cache=empty_cache(), use_cache=True, logits_to_keep=1)
            p.layers = [GrowingLayer(k, v, len(p.request.prompt_ids)) for k, v in layers_of(out.cache)]
        else:
            pos = torch.arange(p.done, end, device=model.device)[None]  # (1, c)
            out = model(input_ids=ids, position_ids=pos, cache=cache_of(p.layers), use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]
