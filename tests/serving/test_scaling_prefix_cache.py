"""The engine's prefix cache finds a prompt's longest cached prefix in work that grows with the prompt, not with
the cache: long multi-turn rollouts (each prompt extends the previous prompt and answer) cached turn by turn, the
ids the cache compares counted (no timing: the machines are shared) at two lengths, beside the hits' exactness."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from clawpipe.serving import prefix_cache
from clawpipe.serving.prefix_cache import PrefixCache


def counting_numpy(count: dict[str, int]) -> Any:
    """numpy, with ``flatnonzero`` counting the ids of the comparisons it reads (how the cache finds a mismatch)."""

    def flatnonzero(a: Any) -> np.ndarray:
        count["compared"] += int(np.size(a))
        return np.flatnonzero(a)

    names = {n: getattr(np, n) for n in dir(np) if not n.startswith("__")}
    return SimpleNamespace(**{**names, "flatnonzero": flatnonzero})


def kv_of(ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A one-layer stand-in for a prefill's KV whose keys are the ids themselves, so a hit shows what it covers."""
    k = torch.tensor(ids, dtype=torch.float64).reshape(1, 1, len(ids), 1)
    return [(k, -k)]


def rollouts(turns: int, n_rollouts: int = 1, seed: int = 0) -> list[list[int]]:
    """The prompts of ``n_rollouts`` rollouts of ``turns`` turns, interleaved turn by turn; they share a system
    prompt and tools (300 ids), and each prompt extends its rollout's previous prompt by an answer and a message."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 50_000, 300).tolist()
    prompts = [list(system) for _ in range(n_rollouts)]
    out = []
    for _ in range(turns):
        for r in range(n_rollouts):
            out.append(prompts[r])
            prompts[r] = prompts[r] + rng.integers(0, 50_000, 40).tolist()
    return out


def serve(prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch, n_rollouts: int) -> tuple[int, list[int]]:
    """Look each prompt up and cache it, as the prefiller does; (ids compared, ids each hit covers)."""
    count = {"compared": 0}
    monkeypatch.setattr(prefix_cache, "np", counting_numpy(count))
    cache = PrefixCache(max_tokens=10**9)
    covered = []
    for k, prompt in enumerate(prompts):
        hit = cache.lookup(prompt)
        if k == 0:
            assert hit is None
        else:
            assert hit is not None
            layers, use = hit
            # the KV of exactly the prompt's own first `use` ids
            assert layers[0][0][0, 0, :use, 0].tolist() == prompt[:use]
            covered.append(use)
        cache.store(prompt, kv_of(prompt), 0)
    monkeypatch.undo()
    return count["compared"], covered


@pytest.mark.parametrize("n_rollouts", [1, 8])
def test_looking_up_a_long_rollout_compares_ids_linear_in_its_prompts(
    monkeypatch: pytest.MonkeyPatch, n_rollouts: int
) -> None:
    """Each turn reuses its rollout's previous prompt whole; the ids compared stay a bounded multiple of the ids
    looked up (comparing with every cached prompt grew with the cache: turns x prompts for one rollout, and every
    rollout's prompt for a group)."""
    per_id = {}
    for turns in (60, 120):
        prompts = rollouts(turns, n_rollouts)
        compared, covered = serve(prompts, monkeypatch, n_rollouts)
        # the other rollouts' first prompts share the system prompt (all of it but the id left to compute); every
        # later one its own rollout's previous prompt
        want = [len(prompts[0]) - 1] * (n_rollouts - 1) + [len(p) for p in prompts[: len(prompts) - n_rollouts]]
        assert covered == want
        per_id[turns] = compared / sum(len(p) for p in prompts)
    assert per_id[120] < 2.5, per_id
    assert per_id[120] / per_id[60] < 1.15, per_id


def test_a_prompt_sharing_less_than_the_minimum_with_the_cache_is_not_a_hit() -> None:
    rng = np.random.default_rng(1)
    base = rng.integers(0, 50_000, 400).tolist()
    cache = PrefixCache(max_tokens=10_000)
    cache.store(base, kv_of(base), 0)
    near = base[: PrefixCache.MIN_TOKENS - 1] + rng.integers(50_000, 60_000, 300).tolist()
    assert cache.lookup(near) is None
    just = base[: PrefixCache.MIN_TOKENS + 5] + rng.integers(50_000, 60_000, 300).tolist()
    hit = cache.lookup(just)
    assert hit is not None and hit[1] == PrefixCache.MIN_TOKENS + 5
    assert cache.lookup(base) is not None and cache.lookup(base)[1] == len(base) - 1  # one id left to compute


def test_evicted_prompts_are_no_longer_found_and_the_cache_stays_in_its_bound() -> None:
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 50_000, 500).tolist() for _ in range(5)]
    cache = PrefixCache(max_tokens=1_200)
    for p in prompts:
        cache.store(p, kv_of(p), 0)
    assert cache._tokens == 1_000  # the last two
    assert cache.lookup(prompts[2] + [1, 2]) is None
    assert cache.lookup(prompts[3] + [1, 2]) is not None
    assert cache.lookup(prompts[4] + [1, 2]) is not None
    assert all(cache._holders.values()) and sum(len(v) for v in cache._holders.values()) == 2 * (500 // 64)
    cache.clear()
    assert cache.lookup(prompts[4]) is None and not cache._holders
