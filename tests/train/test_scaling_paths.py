"""Placing calls on their trees grows with the work: a long rollout's calls get their paths from one walk down the
tree, not a walk up to the root per call (calls x depth). Counted in node lookups, at two lengths, on trees the
trees room built from multi-turn calls."""

from __future__ import annotations

import itertools
import tracemalloc
from collections import Counter
from typing import Any

import numpy as np
import pytest

from clawpipe.train import data
from clawpipe.train.batch import build_batch
from clawpipe.train.config import TrainConfig
from clawpipe.train.data import RolloutInfo, TrainSequence, TrainTree, attach_sequences, flatten_nodes
from clawpipe.trees import build_forest
from tests.trees.test_scaling_trees import multi_turn_calls


class CountingDict(dict):
    """A dict that counts its lookups (``d[k]``, ``k in d``, ``d.get``)."""

    def __init__(self, data: dict, count: Counter) -> None:
        super().__init__(data)
        self.count = count

    def __getitem__(self, key: Any) -> Any:
        self.count["lookups"] += 1
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self.count["lookups"] += 1
        return super().__contains__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.count["lookups"] += 1
        return super().get(key, default)


def _links(calls: Any) -> tuple[list[dict], dict, list[dict]]:
    """The rollout tree's nodes and tree_sequences links of the calls, and the calls' rows."""
    forest = build_forest(calls, run_id="r", iteration=0, scopes=("rollout",))
    rows = calls.to_pylist()
    by_call = {r["call_id"]: r for r in rows}
    links = []
    for s in forest.sequences.to_pylist():
        r = by_call[s["call_id"]]
        links.append(
            {
                **s,
                "n_completion": len(r["completion_token_ids"]),
                "completion_logprobs": r["completion_logprobs"],
            }
        )
    return links, forest.nodes.to_pydict(), rows


def _attach(turns: int, **shape: Any) -> tuple[int, list[dict], TrainTree]:
    shape = shape or {"drift_at": tuple(range(4, turns, 10)), "subagent_every": 25}
    links, nodes, rows = _links(multi_turn_calls(turns, **shape))
    tree, layout = flatten_nodes("rollout:r0", nodes["node_id"], nodes["parent_id"], nodes["token_ids"])
    count: Counter[str] = Counter()
    layout.first = CountingDict(layout.first, count)
    layout.count = CountingDict(layout.count, count)
    layout.parent = CountingDict(layout.parent, count)
    stats: dict[str, float] = {}
    attach_sequences(tree, layout, links, stats)
    assert stats == {"calls": len(rows)}
    return count["lookups"], rows, tree


def test_every_call_of_a_long_rollout_gets_exactly_its_own_tokens() -> None:
    _, rows, tree = _attach(120)
    assert [s.call_id for s in tree.sequences] == [r["call_id"] for r in rows]
    for s, r in zip(tree.sequences, rows, strict=True):
        assert tree.token_ids[s.positions].tolist() == r["prompt_token_ids"] + r["completion_token_ids"]
        assert s.n_prompt == len(r["prompt_token_ids"])
        assert np.array_equal(tree.depth[s.positions], np.arange(len(s.positions)))
    assert tree.n_tokens < sum(len(s.positions) for s in tree.sequences) / 20  # the tree keeps each token once


def test_placing_the_calls_of_a_long_rollout_costs_lookups_linear_in_its_turns() -> None:
    """A rollout of n turns is a chain of about n nodes: walking up from each call's node took n^2/2 lookups."""
    small, _, _ = _attach(100)
    large, _, _ = _attach(200)
    assert large / small < 2.3, (small, large)


def test_a_call_whose_node_is_not_in_the_tree_is_left_out_alone() -> None:
    calls = multi_turn_calls(5)
    forest = build_forest(calls, run_id="r", iteration=0, scopes=("rollout",))
    nodes = forest.nodes.to_pydict()
    tree, layout = flatten_nodes("t", nodes["node_id"], nodes["parent_id"], nodes["token_ids"])
    rows = calls.to_pylist()
    links = [
        {**s, "n_completion": len(r["completion_token_ids"]), "completion_logprobs": r["completion_logprobs"]}
        for s, r in zip(forest.sequences.to_pylist(), rows, strict=True)
    ]
    links[2] = {**links[2], "node_id": 10_000}
    stats: dict[str, float] = {}
    attach_sequences(tree, layout, links, stats)
    assert stats == {"calls": 4, "calls_link_mismatch": 1}
    assert [s.call_id for s in tree.sequences] == [r["call_id"] for k, r in enumerate(rows) if k != 2]


def test_the_calls_of_a_long_rollout_share_their_paths_and_train_in_memory_proportional_to_unique_tokens() -> None:
    """Placing a 300- and a 600-turn rollout's calls and building their batch (two rollouts of one group) peaks
    (tracemalloc) at the same bytes per unique token, under one per flattened token: each call's path is a
    read-only view of its lineage's one array, not a copy of its whole history (8 bytes per flattened token, and
    as much again for each prune of the batch: about 25 in all)."""
    per_unique = {}
    for turns in (300, 600):
        links, nodes, _ = _links(multi_turn_calls(turns, subagent_every=25))
        tracemalloc.start()
        try:
            tree, layout = flatten_nodes("rollout:r0", nodes["node_id"], nodes["parent_id"], nodes["token_ids"])
            attach_sequences(tree, layout, links, {})
            other = TrainTree("rollout:r1", tree.token_ids, tree.prev, tree.depth)
            other.sequences = [TrainSequence(**{**vars(s), "rollout_id": "r1"}) for s in tree.sequences]
            infos = {r: RolloutInfo(r, "g", "h", float(k)) for k, r in enumerate(("r0", "r1"))}
            batch = build_batch([tree, other], infos, TrainConfig(), policy_version=1)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        flattened = sum(len(s.positions) for t in batch.trees for s in t.sequences)
        assert flattened == 2 * tree.flattened_tokens and batch.unique_tokens == 2 * tree.n_tokens
        per_unique[turns] = peak / batch.unique_tokens
        per_flat = peak / flattened  # under a byte per flattened token at 600 turns
    assert per_unique[600] / per_unique[300] < 1.25, per_unique
    assert per_flat < 1, per_flat
    main = [s for s in tree.sequences if len(s.positions) > 200][-5:]  # the main line's last calls
    assert all(np.shares_memory(a.positions, b.positions) for a, b in itertools.pairwise(main))
    assert not main[-1].positions.flags.writeable


def test_pruning_keeps_shared_paths_shared_and_exact() -> None:
    _, rows, tree = _attach(60)
    keep = [s for k, s in enumerate(tree.sequences) if k % 3]  # drops some calls' own tokens
    pruned = tree.pruned(keep)
    assert pruned.n_tokens < tree.n_tokens
    by_call = {r["call_id"]: r for r in rows}
    for s in pruned.sequences:
        r = by_call[s.call_id]
        assert pruned.token_ids[s.positions].tolist() == r["prompt_token_ids"] + r["completion_token_ids"]
        assert np.array_equal(pruned.depth[s.positions], np.arange(len(s.positions)))
        p = pruned.prev[s.positions]
        assert p[0] == -1 and np.array_equal(p[1:], s.positions[:-1])
    shared = sum(np.shares_memory(a.positions, b.positions) for a, b in itertools.pairwise(pruned.sequences))
    assert shared > len(pruned.sequences) / 2


class CountingMarks(np.ndarray):
    """A bool array that counts the positions written into it (how pruning marks the tokens in use)."""

    written = 0

    def __setitem__(self, key: Any, value: Any) -> None:
        CountingMarks.written += int(np.size(np.empty(len(self))[key]))
        super().__setitem__(key, value)


def test_pruning_a_long_rollout_marks_its_tokens_in_work_linear_in_its_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pruning a tree to its kept calls marks each lineage's tokens once (marking each call's whole path wrote the
    flattened tokens: the square of the turns)."""
    real_zeros = np.zeros

    def zeros(shape: Any, dtype: Any = float, **kwargs: Any) -> np.ndarray:
        out = real_zeros(shape, dtype=dtype, **kwargs)
        return out.view(CountingMarks) if dtype is bool else out

    written = {}
    for turns in (100, 200):
        _, _, tree = _attach(turns, subagent_every=25)
        keep = [s for s in tree.sequences[1:] if len(s.positions) > 100]  # the sub-agents' calls go
        CountingMarks.written = 0
        with monkeypatch.context() as m:
            m.setattr(data.np, "zeros", zeros)
            pruned = tree.pruned(keep)
        assert pruned.n_tokens < tree.n_tokens and len(pruned.sequences) == len(keep)
        assert CountingMarks.written < 2 * tree.n_tokens < tree.flattened_tokens / 10
        written[turns] = CountingMarks.written
    assert written[200] / written[100] < 2.3, written
