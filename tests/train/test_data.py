"""Trees from the trees room's tables: radix nodes flattened, and each call placed at the node its link names."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from clawpipe import tables
from clawpipe.errors import TrainingError
from clawpipe.schemas import MODEL_CALLS, ROLLOUTS, TREE_SEQUENCES
from clawpipe.train.config import make_config
from clawpipe.train.data import attach_sequences, flatten_nodes
from clawpipe.train.loading import load_trees
from clawpipe.trees import build_forest
from clawpipe.trees.reconstruct import build_iteration
from tests.trees.training import ROWS


def _calls(seed: int, n_rollouts: int = 5) -> list[dict]:
    """Multi-turn rollouts of one group sharing a prompt, some with identical first answers and retries."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, 9, 6).tolist()
    rows = []
    for r in range(n_rollouts):
        ctx = list(prompt)
        for k in range(int(rng.integers(1, 4))):
            comp = [3, 4] if k == 0 and r < 2 else rng.integers(1, 9, int(rng.integers(1, 4))).tolist()
            rows.append(
                {
                    "call_id": f"r{r}c{k}", "choice_index": 0, "rollout_id": f"r{r}", "group_id": "g", "seq": k,
                    "status": "ok", "token_source": "upstream", "policy_version": 0,
                    "prompt_token_ids": ctx, "completion_token_ids": comp,
                    "completion_logprobs": (-rng.random(len(comp))).tolist(),
                }
            )  # fmt: skip
            ctx = ctx + comp + rng.integers(1, 9, int(rng.integers(0, 3))).tolist()
    return rows


def _links(rows: list[dict], forest_sequences: pa.Table, renumber: dict[int, int]) -> list[dict]:
    by_call = {x["call_id"]: x for x in forest_sequences.to_pylist() if x["scope"] == "group"}
    return [
        {**r, "node_id": renumber[by_call[r["call_id"]]["node_id"]], "n_prompt": len(r["prompt_token_ids"]),
         "n_completion": len(r["completion_token_ids"])}
        for r in rows
    ]  # fmt: skip


def test_each_call_is_the_path_to_its_linked_node_whatever_the_node_numbering():
    rows = _calls(11)
    forest = build_forest(pa.Table.from_pylist(rows, schema=ROWS), run_id="t", iteration=0, scopes=("group",))
    nodes = forest.nodes.to_pylist()
    # renumber nodes breadth first (still parent-first), as another builder may
    depth = {}
    for n in nodes:
        depth[n["node_id"]] = depth[n["parent_id"]] + 1 if n["parent_id"] >= 0 else 0
    order = sorted(nodes, key=lambda n: (depth[n["node_id"]], n["node_id"]))
    new_id = {n["node_id"]: i for i, n in enumerate(order)}
    tree, layout = flatten_nodes(
        "t",
        [new_id[n["node_id"]] for n in order],
        [new_id.get(n["parent_id"], -1) for n in order],
        [n["token_ids"] for n in order],
    )
    assert tree.n_tokens == sum(len(n["token_ids"]) for n in nodes)
    stats: dict[str, float] = {}
    attach_sequences(tree, layout, _links(rows, forest.sequences, new_id), stats)
    assert stats == {"calls": len(rows)}
    for r, s in zip(rows, tree.sequences, strict=True):
        tokens = r["prompt_token_ids"] + r["completion_token_ids"]
        assert s.call_id == r["call_id"] and s.n_prompt == len(r["prompt_token_ids"])
        assert tree.token_ids[s.positions].tolist() == tokens
        assert np.array_equal(tree.depth[s.positions], np.arange(len(tokens)))  # depth = position
        assert all(tree.prev[s.positions[i]] == s.positions[i - 1] for i in range(1, len(tokens)))
        assert s.old_logprobs.tolist() == pytest.approx(r["completion_logprobs"])
    # rollouts 0 and 1 answered [3, 4] first: one set of positions, trained by both
    first = [s for s in tree.sequences if s.call_id in ("r0c0", "r1c0")]
    assert np.array_equal(first[0].gen_positions, first[1].gen_positions)


def test_a_link_that_does_not_fit_its_call_is_counted_and_left_out():
    rows = _calls(3, n_rollouts=2)
    forest = build_forest(pa.Table.from_pylist(rows, schema=ROWS), run_id="t", iteration=0, scopes=("group",))
    cols = forest.nodes.to_pydict()
    tree, layout = flatten_nodes("t", cols["node_id"], cols["parent_id"], cols["token_ids"])
    links = _links(rows, forest.sequences, {i: i for i in cols["node_id"]})
    links[0] = {**links[0], "n_completion": links[0]["n_completion"] + 1}  # the call changed since the build
    links[1] = {**links[1], "node_id": 10_000}  # a node the tree does not have
    stats: dict[str, float] = {}
    attach_sequences(tree, layout, links, stats)
    assert stats == {"calls": len(rows) - 2, "calls_link_mismatch": 2}
    assert [s.call_id for s in tree.sequences] == [r["call_id"] for r in rows[2:]]


def test_trees_without_links_ask_for_a_rebuild(tmp_path):
    rows = [{**r, "run_id": "R", "iteration": 0} for r in _calls(5, n_rollouts=2)]
    for r in rows:
        del r["group_id"]
    rolls = [{"rollout_id": f"r{i}", "run_id": "R", "iteration": 0, "group_id": "g", "reward": float(i),
              "status": "succeeded"} for i in range(2)]  # fmt: skip
    tables.replace_partition(tmp_path, "model_calls", "R", 0, pa.Table.from_pylist(rows, schema=MODEL_CALLS))
    tables.replace_partition(tmp_path, "rollouts", "R", 0, pa.Table.from_pylist(rolls, schema=ROLLOUTS))
    build_iteration(tmp_path, "R", 0)
    trees, _, stats = load_trees(tmp_path, "R", 0, make_config())
    assert stats["calls"] == len(rows) and [t.tree_id for t in trees] == ["group:g"]
    tables.replace_partition(tmp_path, "tree_sequences", "R", 0, TREE_SEQUENCES.empty_table())
    with pytest.raises(TrainingError, match="clawpipe trees build --run R --iteration 0"):
        load_trees(tmp_path, "R", 0, make_config())
