"""Prefix trees: captured calls rebuilt as token tries per rollout and per group (docs/ARCHITECTURE.md, "Tree
semantics").

Public API:
- :func:`build_trees` / :func:`build_iteration`: lake model_calls + rollouts -> lake tree_nodes, tree_stats
  and tree_sequences (the SQL stage in ``sql/trees/`` then the Python builder), idempotent per run and
  iteration.
- :func:`build_forest`: the Python stage alone, Arrow rows of ``sql/trees/calls.sql`` -> a :class:`Forest`
  (nodes, stats, sequences).
- :func:`render_text` / :func:`render_html`: a readable rendering of one tree's nodes.
"""

from __future__ import annotations

from clawpipe.trees.forest import SCOPES, Forest, build_forest, tree_id_of
from clawpipe.trees.labels import CAUSES
from clawpipe.trees.reconstruct import BuildSummary, build_iteration, build_trees

__all__ = [
    "CAUSES",
    "SCOPES",
    "BuildSummary",
    "Forest",
    "build_forest",
    "build_iteration",
    "build_trees",
    "tree_id_of",
]
