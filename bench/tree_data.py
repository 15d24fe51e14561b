"""Production-shaped tree input for the benchmarks: groups of rollouts as ``sql/trees/calls.sql`` rows.

The same distributions as :mod:`data` (log-normal lengths, Zipf-like ids over a 151k vocabulary, logprobs
near 0 with a tail, ~1% failed and ~3% retokenized calls, ~8% ``length`` finishes), drawn as ids rather than
JSON, for benches that start where the SQL stage ends (tree building, tree training):

- a group of ``group_size`` rollouts shares one task prompt (system + task, a third of the median prompt),
  as a GRPO group does; each rollout then goes its own way;
- each call's prompt is the previous prompt, the previous answer and a tool result or user message;
  a failed call's prompt is sent again;
- branches at production-like rates (:class:`Branching`): retries, n=2 choices, drift (the next prompt
  re-encodes a few ids of the answer), sub-agents under their own system prompt, and compaction (the
  history replaced by a summary) whenever a prompt would pass the shape's ``context``.

Rows carry ids as int32 numpy arrays; :func:`table` turns them into the Arrow table the builder reads.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from data import CallGen, Shape

TEMPLATE_HEAD = 8  # ids every prompt starts with (the chat template's opening): a sub-agent shares only these


@dataclass
class Branching:
    """How often rollouts branch (per call unless said), beside the task prompt a group shares."""

    retry: float = 0.02  # the same prompt sent again (a timeout, a rejected answer); the rollout goes on from it
    choices: float = 0.02  # n=2 on a call
    drift: float = 0.03  # the next prompt re-encodes two or three ids of the answer differently
    subagent: float = 0.1  # per rollout: a sub-agent of 2-4 calls under its own system prompt


class TreeGen:
    """Draws groups of rollouts (rows of ``sql/trees/calls.sql``) from one seed."""

    def __init__(self, seed: int, shp: Shape, branching: Branching | None = None) -> None:
        self.gen = CallGen(seed, shp)
        self.rng, self.shape = self.gen.rng, shp
        self.br = branching or Branching()

    def group(self, group_id: str, size: int, *, iteration: int = 0) -> list[dict[str, Any]]:
        """The calls of one group: ``size`` rollouts sharing a task prompt, in call order per rollout."""
        task = self._ids(self.gen.length(self.shape.prompt // 3))
        rows: list[dict[str, Any]] = []
        for i in range(size):
            reward = float(self.rng.beta(2, 3))
            self._rollout(f"{group_id}-r{i}", task, rows, group_id=group_id, sample_idx=i, reward=reward)
        return rows

    def _ids(self, n: int) -> np.ndarray:
        return self.gen.ids(n).astype(np.int32)

    def _limit(self) -> int:
        return self.shape.context or 1 << 62

    def _rollout(self, rid: str, task: np.ndarray, rows: list[dict[str, Any]], **common: Any) -> None:
        rng, shp, br = self.rng, self.shape, self.br
        n_turns = max(1, int(rng.integers(shp.turns // 2 + 1, shp.turns * 2)))
        grow = max(1, int((2 * shp.prompt / 3) / max(1.0, (n_turns - 1) / 2) - shp.sampled))
        sub_at = int(rng.integers(n_turns)) if rng.random() < br.subagent else -1
        prompt, seq = task, 0
        for k in range(n_turns):
            answer, failed = self._call(rows, rid, seq, prompt, common)
            seq += 1
            if rng.random() < br.retry and not failed:  # sent again; the harness keeps the second answer
                answer, failed = self._call(rows, rid, seq, prompt, common)
                seq += 1
            if k == sub_at:
                seq = self._subagent(rows, rid, seq, task, common)
            if failed:
                continue  # the harness sends the same prompt again
            if len(answer) > 1 and rng.random() < br.drift:
                answer = self._drift(answer)
            added = self._ids(self.gen.length(grow))
            nxt = np.concatenate([prompt, answer, added])
            room = self._limit() - 4 * shp.sampled  # a prompt leaves room for the longest answer
            if len(nxt) > room:  # compaction: the task and a summary of the work so far
                summary = min(self.gen.length(shp.prompt // 8), max(1, room - len(task)))
                nxt = np.concatenate([task, self._ids(summary)])
            prompt = nxt

    def _call(
        self, rows: list[dict[str, Any]], rid: str, seq: int, prompt: np.ndarray, common: dict[str, Any]
    ) -> tuple[np.ndarray, bool]:
        """One call (and a second choice on some); returns the answer the rollout goes on with, and failure."""
        rng, shp = self.rng, self.shape
        u = float(rng.random())
        failed, retok = u < shp.error_rate, 1 - u < shp.retokenized_rate
        call_id = uuid.uuid4().hex
        n_choices = 2 if rng.random() < self.br.choices and not failed else 1
        answer = np.zeros(0, dtype=np.int32)
        for choice in range(n_choices):
            n_gen = 0 if failed else min(self.gen.length(shp.sampled), shp.sampled * 4)
            sampled = self._ids(n_gen)
            rows.append(
                {
                    "call_id": call_id,
                    "choice_index": choice,
                    "rollout_id": rid,
                    "seq": seq,
                    "status": "http_error" if failed else "ok",
                    "token_source": "none" if failed else ("retokenized" if retok else "upstream"),
                    "finish_reason": None if failed else ("length" if rng.random() < 0.08 else "stop"),
                    "policy_version": 0,
                    "prompt_token_ids": prompt,
                    "completion_token_ids": sampled,
                    "completion_logprobs": self.gen.logprobs(n_gen).astype(np.float32),
                    **common,
                }
            )
            if choice == 0:
                answer = sampled
        return answer, failed

    def _subagent(self, rows: list[dict[str, Any]], rid: str, seq: int, task: np.ndarray, common: dict) -> int:
        """2-4 calls under the sub-agent's own system prompt (only the template's opening is shared)."""
        shp = self.shape
        prompt = np.concatenate([task[:TEMPLATE_HEAD], self._ids(self.gen.length(shp.prompt // 6))])
        for _ in range(int(self.rng.integers(2, 5))):
            answer, failed = self._call(rows, rid, seq, prompt, common)
            seq += 1
            if not failed:
                prompt = np.concatenate([prompt, answer, self._ids(self.gen.length(shp.sampled))])
        return seq

    def _drift(self, answer: np.ndarray) -> np.ndarray:
        """The answer as the next prompt carries it: two ids from the second on re-encoded as three others."""
        at = int(self.rng.integers(1, len(answer)))
        return np.concatenate([answer[:at], self._ids(3), answer[at + 2 :]])


def groups(
    n_groups: int,
    shp: Shape,
    *,
    group_size: int = 8,
    seed: int = 0,
    branching: Branching | None = None,
    start: int = 0,
) -> Iterator[list[dict[str, Any]]]:
    """The rows of groups ``start .. start + n_groups - 1`` (ids ``g<k>``), one list per group."""
    gen = TreeGen(seed, shp, branching)
    for g in range(start, start + n_groups):
        yield gen.group(f"g{g}", group_size)


def _lists(arrs: list[np.ndarray], typ: pa.DataType) -> pa.Array:
    off = np.zeros(len(arrs) + 1, dtype=np.int32)
    np.cumsum([len(a) for a in arrs], out=off[1:])
    values = np.concatenate(arrs) if arrs else np.zeros(0)
    return pa.ListArray.from_arrays(pa.array(off), pa.array(values, typ))


def table(rows: list[dict[str, Any]]) -> pa.Table:
    """The rows as the Arrow table ``sql/trees/calls.sql`` gives the builder."""
    lists = {
        "prompt_token_ids": pa.int32(),
        "completion_token_ids": pa.int32(),
        "completion_logprobs": pa.float32(),
    }
    cols: dict[str, Any] = {
        "call_id": [r["call_id"] for r in rows],
        "choice_index": pa.array([r["choice_index"] for r in rows], pa.int32()),
        "rollout_id": [r["rollout_id"] for r in rows],
        "seq": pa.array([r["seq"] for r in rows], pa.int64()),
        "group_id": [r["group_id"] for r in rows],
        "sample_idx": pa.array([r["sample_idx"] for r in rows], pa.int32()),
        "status": [r["status"] for r in rows],
        "token_source": [r["token_source"] for r in rows],
        "finish_reason": [r["finish_reason"] for r in rows],
        "policy_version": pa.array([r["policy_version"] for r in rows], pa.int64()),
        "reward": pa.array([r["reward"] for r in rows], pa.float64()),
    }
    for name, typ in lists.items():
        cols[name] = _lists([r[name] for r in rows], typ)
    return pa.table(cols)
