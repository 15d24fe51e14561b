"""Training trees from raw sequences, built the way training gets them: by the trees room, then placed by data.py.

For training tests and benchmarks that need a :class:`~clawpipe.train.data.TrainTree` without a lake: the
sequences become model_calls-shaped rows, :func:`clawpipe.trees.build_forest` builds their group tree and the
call-to-path links, and :func:`clawpipe.train.data.flatten_nodes` / :func:`~clawpipe.train.data.attach_sequences`
lay it out as training does with the lake's tree_nodes and tree_sequences.
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa

from clawpipe.train.data import TrainTree, attach_sequences, flatten_nodes
from clawpipe.trees import build_forest

ROWS = pa.schema(
    [
        ("call_id", pa.string()),
        ("choice_index", pa.int32()),
        ("rollout_id", pa.string()),
        ("group_id", pa.string()),
        ("seq", pa.int64()),
        ("status", pa.string()),
        ("token_source", pa.string()),
        ("policy_version", pa.int64()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("completion_token_ids", pa.list_(pa.int32())),
        ("completion_logprobs", pa.list_(pa.float32())),
    ]
)


def build_tree(tree_id: str, sequences: Iterable[dict]) -> TrainTree:
    """One tree over the sequences, with its TrainSequences in the given order.

    Each dict has ``tokens`` (prompt + completion ids), ``n_prompt``, ``rollout_id``, optional ``call_id``,
    ``choice_index``, ``old_logprobs`` (default zeros) and ``policy_version``.
    """
    rows = []
    for k, s in enumerate(sequences):
        tokens = [int(t) for t in s["tokens"]]
        n_prompt = int(s["n_prompt"])
        completion = tokens[n_prompt:]
        lps = s.get("old_logprobs")
        rows.append(
            {
                "call_id": str(s.get("call_id", f"{tree_id}-c{k}")),
                "choice_index": int(s.get("choice_index", 0)),
                "rollout_id": str(s["rollout_id"]),
                "group_id": tree_id,
                "seq": k,
                "status": "ok",
                "token_source": "upstream",
                "policy_version": s.get("policy_version"),
                "prompt_token_ids": tokens[:n_prompt],
                "completion_token_ids": completion,
                "completion_logprobs": [float(x) for x in lps] if lps is not None else [0.0] * len(completion),
            }
        )
    forest = build_forest(pa.Table.from_pylist(rows, schema=ROWS), run_id="t", iteration=0, scopes=("group",))
    nodes = forest.nodes.to_pydict()
    tree, layout = flatten_nodes(tree_id, nodes["node_id"], nodes["parent_id"], nodes["token_ids"])
    end_of = {(x["call_id"], x["choice_index"]): x for x in forest.sequences.to_pylist()}
    links = []
    for r in rows:
        link = end_of[(r["call_id"], r["choice_index"])]
        links.append(
            {
                **r,
                "node_id": link["node_id"],
                "n_prompt": link["n_prompt"],
                "n_completion": len(r["completion_token_ids"]),
            }
        )
    stats: dict[str, float] = {}
    attach_sequences(tree, layout, links, stats)
    assert not stats.get("calls_link_mismatch"), f"{tree_id}: a sequence does not fit its link"
    return tree
