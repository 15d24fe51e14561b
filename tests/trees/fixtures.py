"""Hand-made call sets for tree tests: rows shaped like model_calls / rollouts, written to a real lake."""

from __future__ import annotations

import zlib
from pathlib import Path

import pyarrow as pa

from clawpipe import schemas, tables


def call(
    call_id: str,
    rollout_id: str,
    seq: int,
    prompt: list[int] | None,
    completion: list[int] | None,
    *,
    choice: int = 0,
    status: str = "ok",
    token_source: str = "upstream",
    finish_reason: str = "stop",
    policy_version: int = 1,
    logprobs: list[float] | None = None,
) -> dict:
    """One model_calls row; logprobs default to a distinct value per (call, choice, token)."""
    base = (zlib.crc32(call_id.encode()) % 97) + choice * 0.5
    if logprobs is None and completion is not None:
        logprobs = [-(base + i) / 100.0 for i in range(len(completion))]
    return {
        "call_id": call_id,
        "choice_index": choice,
        "rollout_id": rollout_id,
        "seq": seq,
        "status": status,
        "token_source": token_source,
        "finish_reason": finish_reason,
        "policy_version": policy_version,
        "prompt_token_ids": prompt,
        "completion_token_ids": completion,
        "completion_logprobs": logprobs,
    }


def rollout(rollout_id: str, group_id: str | None, reward: float | None, sample_idx: int = 0) -> dict:
    return {"rollout_id": rollout_id, "group_id": group_id, "reward": reward, "sample_idx": sample_idx}


def write_lake(lake: Path, run_id: str, iteration: int, calls: list[dict], rollouts: list[dict]) -> None:
    """Write the calls and rollouts as the (run, iteration) partitions of model_calls and rollouts."""
    crow = [{**c, "run_id": run_id, "iteration": iteration} for c in calls]
    rrow = [{**r, "run_id": run_id, "iteration": iteration, "status": "succeeded"} for r in rollouts]
    tables.replace_partition(lake, "model_calls", run_id, iteration, pa.Table.from_pylist(crow, schemas.MODEL_CALLS))
    tables.replace_partition(lake, "rollouts", run_id, iteration, pa.Table.from_pylist(rrow, schemas.ROLLOUTS))


def read_tree(lake: Path, run_id: str, iteration: int, tree_id: str) -> list[dict]:
    con = tables.connect(lake)
    rel = con.sql(
        "select * from tree_nodes where run_id = $r and iteration = $i and tree_id = $t order by node_id",
        params={"r": run_id, "i": iteration, "t": tree_id},
    )
    return rel.to_arrow_table().to_pylist()


def read_stats(lake: Path, run_id: str, iteration: int) -> dict[str, dict]:
    con = tables.connect(lake)
    rel = con.sql("select * from tree_stats where run_id = $r and iteration = $i", params={"r": run_id, "i": iteration})
    return {s["tree_id"]: s for s in rel.to_arrow_table().to_pylist()}


def locate(nodes: list[dict], tokens: list[int], *, partial: bool = False) -> list[int] | None:
    """Node ids of the root-to-node path spelling exactly ``tokens``, or None when there is none.

    With ``partial`` the path may end inside its last node. Also asserts the trie property on the way:
    siblings never start with the same token.
    """
    kids: dict[int, list[dict]] = {}
    for n in nodes:
        kids.setdefault(n["parent_id"], []).append(n)
    for ch in kids.values():
        firsts = [c["token_ids"][0] for c in ch]
        assert len(firsts) == len(set(firsts)), f"siblings share a first token: {ch}"
    path: list[int] = []
    at, i = -1, 0
    while i < len(tokens):
        nxt = [c for c in kids.get(at, []) if c["token_ids"][0] == tokens[i]]
        if not nxt:
            return None
        node = nxt[0]
        seg = node["token_ids"]
        if tokens[i : i + len(seg)] != seg and not (partial and seg[: len(tokens) - i] == tokens[i:]):
            return None
        assert node["depth"] == i
        path.append(node["node_id"])
        at, i = node["node_id"], i + len(seg)
    return path
