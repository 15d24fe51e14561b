"""The two shapes one tree's build works on: its input sequences and its output nodes.

They live apart from the builder (prefix_tree.py) and the branch labeller (labels.py), which both use them,
so neither of those imports the other's module for its types.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np


class Keys(Sequence[bytes]):
    """Sequence keys built when asked for (``key_of(row)``), not held: a long rollout's keys replay its history
    at every call, so all of them at once would hold every flattened token. ``length(j)`` is key j's length in
    tokens without building it."""

    def __init__(self, rows: list[int], key_of: Callable[[int], bytes], length_of: Callable[[int], int]) -> None:
        self.rows = rows
        self._key_of = key_of
        self._length_of = length_of

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, j: int) -> bytes: ...
    @overload
    def __getitem__(self, j: slice) -> Sequence[bytes]: ...
    def __getitem__(self, j: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(j, slice):
            return self.take(list(range(len(self.rows)))[j])
        return self._key_of(self.rows[j])

    def length(self, j: int) -> int:
        return self._length_of(self.rows[j])

    def take(self, js: list[int]) -> Keys:
        """The keys of these positions, in this order."""
        return Keys([self.rows[j] for j in js], self._key_of, self._length_of)


@dataclass
class TreeSequences:
    """The sequences of one tree, in rank order (index j: smaller j = earlier call).

    ``keys[j]`` are the tokens as big-endian uint32 bytes (prompt then the completion part that counts);
    ``plen[j]`` the prompt length; ``glen[j]`` how many completion tokens are generated in the tree (0 for a
    failed call, whose prompt is context only); ``call[j]`` and ``rollout[j]`` small integer codes.
    """

    keys: Sequence[bytes]  # a list, or :class:`Keys` built when asked for
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
