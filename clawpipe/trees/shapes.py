"""The two shapes one tree's build works on: its input sequences and its output nodes.

They live apart from the builder (prefix_tree.py) and the branch labeller (labels.py), which both use them,
so neither of those imports the other's module for its types.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TreeSequences:
    """The sequences of one tree, in rank order (index j: smaller j = earlier call).

    ``keys[j]`` are the tokens as big-endian uint32 bytes (prompt then the completion part that counts);
    ``plen[j]`` the prompt length; ``glen[j]`` how many completion tokens are generated in the tree (0 for a
    failed call, whose prompt is context only); ``call[j]`` and ``rollout[j]`` small integer codes.
    """

    keys: list[bytes]
    plen: list[int]
    glen: list[int]
    call: list[int]
    rollout: list[int]


@dataclass
class TreeNodes:
    """Nodes of one tree in preorder (index = node_id); token ranges refer to the ``rep`` sequence."""

    start: np.ndarray  # (N,) int64 depth of the first token
    end: np.ndarray  # (N,) int64 depth after the last token
    parent: np.ndarray  # (N,) int64, -1 for root children
    rep: np.ndarray  # (N,) int64 sequence whose tokens [start, end) are the node's tokens
    gen: np.ndarray  # (N,) int64 generating sequence (earliest), -1 for context
    n_gen: np.ndarray  # (N,) int64 sequences generating the node's tokens
    n_seqs: np.ndarray  # (N,) int64 sequences passing through
    n_leaves: np.ndarray  # (N,) int64
    is_leaf: np.ndarray  # (N,) bool
    rollouts: list[list[int]]  # rollout codes passing through, ascending
    leaf_rollouts: list[list[int]]  # rollouts whose sequences end at the node (leaves' rewards)
    cause: np.ndarray  # (N,) int8, 0 = no branch starts here
    cause_seq: np.ndarray  # (N,) int64 the earliest sequence through a branch node (the later call), or -1
    drift_seq: np.ndarray  # (N,) int64 drift: the earlier sequence whose generated tokens the branch leaves
    end_node: np.ndarray  # (S,) int64 node where each sequence ends
    drift_affected: int  # sequences whose path passes through a drift node
