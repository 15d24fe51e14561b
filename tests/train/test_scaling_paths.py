"""Placing calls on their trees grows with the work: a long rollout's calls get their paths from one walk down the
tree, not a walk up to the root per call (calls x depth). Counted in node lookups, at two lengths, on trees the
trees room built from multi-turn calls."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from clawpipe.train.data import attach_sequences, flatten_nodes
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


def _attach(turns: int) -> tuple[int, list[dict], Any]:
    calls = multi_turn_calls(turns, drift_at=tuple(range(4, turns, 10)), subagent_every=25)
    forest = build_forest(calls, run_id="r", iteration=0, scopes=("rollout",))
    nodes = forest.nodes.to_pydict()
    tree, layout = flatten_nodes("rollout:r0", nodes["node_id"], nodes["parent_id"], nodes["token_ids"])
    count: Counter[str] = Counter()
    layout.first = CountingDict(layout.first, count)
    layout.count = CountingDict(layout.count, count)
    layout.parent = CountingDict(layout.parent, count)
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
