"""Tree building grows with the work, not its square: long multi-turn rollouts (each prompt extends the previous
prompt and answer) built at two lengths, the Python steps of the builder counted (no timing: the machines are
shared), and the builder's peak memory compared with the unique and the flattened tokens."""

from __future__ import annotations

import sys
import tracemalloc
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from clawpipe.trees import build_forest
from tests.trees.training import ROWS


def multi_turn_calls(
    turns: int,
    *,
    rollout: str = "r0",
    group: str = "g",
    seed: int = 0,
    system: int = 64,
    answer: int = 12,
    user: int = 8,
    drift_at: tuple[int, ...] = (),
    subagent_every: int = 0,
) -> pa.Table:
    """Rows shaped like sql/trees/calls.sql of one rollout of ``turns`` calls: each prompt is the previous prompt,
    the previous answer and a user message. The answers of the turns in ``drift_at`` come back re-encoded (one id
    changed); every ``subagent_every``-th turn also calls a sub-agent with a system prompt of its own."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 30000, system).tolist()
    rows: list[dict[str, Any]] = []

    def add(p: list[int], c: list[int]) -> None:
        k = len(rows)
        rows.append(
            {
                "call_id": f"{rollout}-c{k}",
                "choice_index": 0,
                "rollout_id": rollout,
                "group_id": group,
                "seq": k,
                "status": "ok",
                "token_source": "upstream",
                "policy_version": 1,
                "prompt_token_ids": p,
                "completion_token_ids": c,
                "completion_logprobs": [-0.5] * len(c),
            }
        )

    for t in range(turns):
        completion = rng.integers(0, 30000, answer).tolist()
        add(prompt, completion)
        if subagent_every and t % subagent_every == subagent_every - 1:
            add(rng.integers(0, 30000, system).tolist(), rng.integers(0, 30000, answer).tolist())
        replay = list(completion)
        if t in drift_at:
            replay[answer // 2] = (replay[answer // 2] + 1) % 30000
        prompt = prompt + replay + rng.integers(0, 30000, user).tolist()
    return pa.Table.from_pylist(rows, schema=ROWS)


def lines_run(fn: Callable[[], Any], path_part: str) -> tuple[int, Any]:
    """(Python lines executed in files whose path holds ``path_part`` while ``fn`` runs, its result): a count of
    interpreted steps, where a vectorised numpy call is one step, so it shows per-token or per-pair Python work."""
    count = Counter[str]()

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            count["lines"] += 1
        return local

    def trace(frame: Any, event: str, arg: Any) -> Any:
        return local if path_part in frame.f_code.co_filename else None

    sys.settrace(trace)
    try:
        out = fn()
    finally:
        sys.settrace(None)
    return count["lines"], out


def test_a_long_rollout_with_an_early_drift_costs_steps_linear_in_its_turns() -> None:
    """An answer re-encoded at turn 2 puts every later call below the drift node; finding those calls walked up
    from each call's node to the root (calls x depth: 4x the steps for 2x the turns)."""
    counts = {}
    for turns in (100, 200):
        calls = multi_turn_calls(turns, drift_at=(2,))
        steps, forest = lines_run(
            lambda calls=calls: build_forest(calls, run_id="r", iteration=0, scopes=("rollout",)), "clawpipe/trees/"
        )
        stats = forest.stats.to_pylist()[0]
        assert stats["branches_drift"] == 1
        assert stats["drift_count"] == turns - 3  # the calls after the re-encoded answer
        counts[turns] = steps
    assert counts[200] / counts[100] < 2.3, counts


def _peak_bytes(calls: pa.Table) -> tuple[int, dict[str, Any]]:
    """The builder's own peak (tracemalloc: the Arrow input is not Python's) and the rollout tree's stats."""
    tracemalloc.start()
    try:
        forest = build_forest(calls, run_id="r", iteration=0, scopes=("rollout",))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, forest.stats.to_pylist()[0]


def test_a_long_rollout_is_built_in_memory_proportional_to_its_unique_tokens() -> None:
    """A rollout of 300 and of 600 turns with sub-agents: the builder's peak per unique token stays put and is a
    small part of the flattened tokens (holding every call's whole sequence as a sort key took 4 bytes per
    flattened token, with a big-endian copy of the batch's ids 8: the square of the turns)."""
    per_unique = {}
    for turns in (300, 600):
        peak, stats = _peak_bytes(multi_turn_calls(turns, subagent_every=25))
        assert stats["flattened_tokens"] > 80 * stats["unique_tokens"]  # a long rollout replays its history
        assert peak < stats["flattened_tokens"], (peak, stats)  # under a byte per flattened token
        per_unique[turns] = peak / stats["unique_tokens"]
    assert per_unique[600] / per_unique[300] < 1.2, per_unique
