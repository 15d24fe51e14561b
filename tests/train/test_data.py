"""Trees from tree_nodes rows: flattening radix nodes and locating call sequences as root-to-token paths."""

from __future__ import annotations

import numpy as np

from clawpipe.train.data import locate_sequence, tree_from_nodes
from tests.train.helpers import radix_node_rows, random_group_trees


def test_sequences_are_found_whatever_the_node_numbering():
    trees, _ = random_group_trees(11, n_groups=1, group_size=6)
    tree = trees[0]
    rows = radix_node_rows(tree)
    # renumber nodes breadth first (still parent-first), as a builder may
    depth = {r["node_id"]: 0 for r in rows}
    for r in rows:
        if r["parent_id"] >= 0:
            depth[r["node_id"]] = depth[r["parent_id"]] + 1
    order = sorted(rows, key=lambda r: (depth[r["node_id"]], r["node_id"]))
    new_id = {r["node_id"]: i for i, r in enumerate(order)}
    flat = tree_from_nodes(
        "t",
        [new_id[r["node_id"]] for r in order],
        [new_id.get(r["parent_id"], -1) for r in order],
        [r["token_ids"] for r in order],
    )
    assert flat.n_tokens == tree.n_tokens
    kids = flat.children()
    for s in tree.sequences:
        tokens = tree.token_ids[s.positions]
        path = locate_sequence(flat, kids, tokens)
        assert path is not None
        assert np.array_equal(flat.token_ids[path], tokens)
        assert np.array_equal(flat.depth[path], np.arange(len(tokens)))  # depth = position
        assert all(flat.prev[path[i]] == path[i - 1] for i in range(1, len(path)))
    assert locate_sequence(flat, kids, np.asarray([999, 1])) is None


def test_generated_and_context_siblings_with_the_same_first_token():
    """After [1, 2] a generated [3, 4] and a context [3, 5]: [1, 2, 3, 5] must take the second branch."""
    tree = tree_from_nodes("t", [0, 1, 2], [-1, 0, 0], [[1, 2], [3, 4], [3, 5]])
    kids = tree.children()
    path = locate_sequence(tree, kids, np.asarray([1, 2, 3, 5]))
    assert path is not None and tree.token_ids[path].tolist() == [1, 2, 3, 5]
    assert path[2] != locate_sequence(tree, kids, np.asarray([1, 2, 3, 4]))[2]
    # a sequence may end inside a node
    assert tree.token_ids[locate_sequence(tree, kids, np.asarray([1, 2, 3]))].tolist() == [1, 2, 3]
