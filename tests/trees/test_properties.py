"""Properties of tree reconstruction on generated call sets (hypothesis), through build_forest."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clawpipe.trees import build_forest
from tests.trees.fixtures import call, locate

VOCAB = st.integers(min_value=0, max_value=3)  # a tiny vocabulary forces shared prefixes and collisions
TOKENS = st.lists(VOCAB, min_size=0, max_size=4)


@st.composite
def call_sets(draw: st.DrawFn) -> list[dict]:
    """Rollouts of one group whose calls extend, retry, rewrite, drift from or ignore earlier calls."""
    task = draw(st.lists(VOCAB, min_size=1, max_size=4))
    rows: list[dict] = []
    for r in range(draw(st.integers(1, 3))):
        rid = f"r{r}"
        seqs: list[list[int]] = []  # full sequences of this rollout's earlier calls
        prompts: list[list[int]] = []
        for k in range(draw(st.integers(1, 5))):
            op = draw(st.sampled_from(["extend", "retry", "rewrite", "drift", "fresh"])) if seqs else "fresh"
            j = draw(st.integers(0, len(seqs) - 1)) if seqs else 0
            if op == "extend":
                prompt = seqs[j] + draw(TOKENS)
            elif op == "retry":
                prompt = list(prompts[draw(st.integers(0, len(prompts) - 1))])
            elif op == "rewrite":
                cut = draw(st.integers(0, len(seqs[j])))
                prompt = seqs[j][:cut] + draw(TOKENS)
            elif op == "drift" and seqs[j]:
                at = draw(st.integers(0, len(seqs[j]) - 1))
                prompt = [*seqs[j][:at], draw(VOCAB), *seqs[j][at + 1 :], *draw(TOKENS)]
            else:
                prompt = (task if draw(st.booleans()) else []) + draw(TOKENS)
            if not prompt:
                prompt = [draw(VOCAB)]
            cid = f"{rid}-c{k}"
            status = draw(st.sampled_from(["ok", "ok", "ok", "upstream_error"]))
            source = draw(st.sampled_from(["upstream"] * 5 + ["retokenized"]))
            for choice in range(draw(st.integers(1, 2))):
                completion = draw(TOKENS) if status == "ok" else None
                rows.append(
                    {
                        **call(cid, rid, k, prompt, completion, choice=choice, status=status, token_source=source),
                        "group_id": "g",
                        "reward": float(r),
                    }
                )
                seqs.append(prompt + (completion or []))
            prompts.append(prompt)
    return rows


def _in_tree(rows: list[dict]) -> list[tuple[dict, list[int], int]]:
    """(row, sequence, generated length) of every call x choice that belongs in the trees."""
    out = []
    for c in rows:
        if c["token_source"] != "upstream":
            continue
        gen = c["completion_token_ids"] if c["status"] == "ok" and c["completion_token_ids"] else []
        seq = c["prompt_token_ids"] + gen
        if seq:
            out.append((c, seq, len(gen)))
    return out


def _trees(nodes: pa.Table) -> dict[str, list[dict]]:
    trees: dict[str, list[dict]] = {}
    for n in nodes.to_pylist():
        trees.setdefault(n["tree_id"], []).append(n)
    return trees


def _check_tree(tree: list[dict], members: list[tuple[dict, list[int], int]]) -> None:
    by_id = {n["node_id"]: n for n in tree}
    seq_of = {(c["call_id"], c["choice_index"]): (c, s, g) for c, s, g in members}
    for c, seq, glen in members:
        path = locate(tree, seq)
        assert path is not None, f"{c['call_id']}/{c['choice_index']} {seq} is not exactly one root-to-node path"
        # every generated token lies in a generated node; the node's generator really generated it
        for nid in path:
            node = by_id[nid]
            lo, hi = node["depth"], node["depth"] + len(node["token_ids"])
            if hi <= len(seq) - glen:
                continue
            assert node["generated"], f"generated tokens of {c['call_id']} in a context node"
            gc, gseq, gglen = seq_of[(node["call_id"], node["choice_index"])]
            assert gseq[:hi] == seq[:hi] and lo >= len(gseq) - gglen
            off = lo - (len(gseq) - gglen)
            assert node["logprobs"] == pytest.approx(gc["completion_logprobs"][off : off + hi - lo], rel=1e-6)
            if (node["call_id"], node["choice_index"]) != (c["call_id"], c["choice_index"]):
                assert node["n_generated"] >= 2  # an identical sample of another call shares the node
    # structure: parent-first ids, depth = tokens above, aggregates consistent, leaves carry rewards
    assert [n["node_id"] for n in tree] == list(range(len(tree)))
    kids: dict[int, list[dict]] = {}
    for n in tree:
        assert n["parent_id"] < n["node_id"] and n["token_ids"]
        parent = by_id.get(n["parent_id"])
        assert n["depth"] == (parent["depth"] + len(parent["token_ids"]) if parent else 0)
        kids.setdefault(n["parent_id"], []).append(n)
    assert sum(n["n_seqs"] for n in kids.get(-1, [])) == len(members)
    reward_of = {c["rollout_id"]: c["reward"] for c, _, _ in members}
    for n in tree:
        ch = kids.get(n["node_id"], [])
        assert n["is_leaf"] == (not ch)
        assert n["n_leaves"] == (sum(c["n_leaves"] for c in ch) if ch else 1)
        assert n["n_seqs"] >= sum(c["n_seqs"] for c in ch)
        if n["is_leaf"]:
            rs = [reward_of[r] for r in n["rollout_ids"]]
            assert n["reward"] == pytest.approx(sum(rs) / len(rs))
    # every branch (each child but one, per parent) is labelled with a cause, and nothing else is
    assert sum(n["branch_cause"] is not None for n in tree) == sum(len(ch) - 1 for ch in kids.values())
    for ch in kids.values():
        assert sum(c["branch_cause"] is None for c in ch) == 1
    gen_total = sum(n["n_generated"] * len(n["token_ids"]) for n in tree if n["generated"])
    assert gen_total == sum(g for _, _, g in members)  # every generated token appears generated exactly once
    assert all(n["n_generated"] == 0 for n in tree if not n["generated"])


@settings(max_examples=200, deadline=None)
@given(rows=call_sets())
def test_every_sequence_is_one_path_and_every_generated_token_appears_once(rows: list[dict]) -> None:
    nodes, stats, _ = build_forest(pa.Table.from_pylist(rows), run_id="R", iteration=0)
    trees = _trees(nodes)
    members = _in_tree(rows)
    for tid, tree in trees.items():
        scope, key = tid.split(":", 1)
        mine = [m for m in members if scope == "group" or m[0]["rollout_id"] == key]
        _check_tree(tree, mine)
    assert len(stats) == len({c["rollout_id"] for c in rows}) + 1


@settings(max_examples=120, deadline=None)
@given(rows=call_sets(), seed=st.integers(0, 2**16))
def test_result_does_not_depend_on_arrival_order(rows: list[dict], seed: int) -> None:
    shuffled = list(rows)
    random.Random(seed).shuffle(shuffled)
    a = build_forest(pa.Table.from_pylist(rows), run_id="R", iteration=0)
    b = build_forest(pa.Table.from_pylist(shuffled), run_id="R", iteration=0)
    assert a.nodes.equals(b.nodes) and a.stats.equals(b.stats) and a.sequences.equals(b.sequences)


@settings(max_examples=200, deadline=None)
@given(rows=call_sets())
def test_each_call_in_a_tree_is_linked_once_to_the_node_where_its_path_ends(rows: list[dict]) -> None:
    nodes, _, links = build_forest(pa.Table.from_pylist(rows), run_id="R", iteration=0)
    trees = _trees(nodes)
    by_key = {(x["tree_id"], x["call_id"], x["choice_index"]): x for x in links.to_pylist()}
    members = _in_tree(rows)
    expected = set()
    for c, seq, glen in members:
        for tid in (f"rollout:{c['rollout_id']}", "group:g"):
            key = (tid, c["call_id"], c["choice_index"])
            expected.add(key)
            link = by_key[key]
            assert locate(trees[tid], seq)[-1] == link["node_id"]
            assert (link["n_prompt"], link["n_generated"]) == (len(c["prompt_token_ids"]), glen)
            assert link["rollout_id"] == c["rollout_id"] and link["scope"] == tid.split(":")[0]
    assert set(by_key) == expected and len(links) == len(expected)  # once per tree, kept-out calls absent


@settings(max_examples=120, deadline=None)
@given(rows=call_sets())
def test_unique_tokens_never_exceed_flattened_and_equal_only_without_sharing(rows: list[dict]) -> None:
    nodes, stats, _ = build_forest(pa.Table.from_pylist(rows), run_id="R", iteration=0)
    trees = _trees(nodes)
    for s in stats.to_pylist():
        tree = trees.get(s["tree_id"], [])
        assert s["unique_tokens"] == sum(len(n["token_ids"]) for n in tree)
        assert s["unique_tokens"] <= s["flattened_tokens"]
        nothing_shared = all(n["n_seqs"] == 1 for n in tree)
        assert (s["unique_tokens"] == s["flattened_tokens"]) == nothing_shared
        assert s["n_leaves"] == sum(n["is_leaf"] for n in tree)
        assert s["n_nodes"] == len(tree)


def _paths(tree: list[dict], members: list[tuple[dict, list[int], int]]) -> list[tuple[dict, list[int]]]:
    out = []
    for c, seq, _ in members:
        path = locate(tree, seq)
        assert path is not None
        out.append((c, path))
    return out


@settings(max_examples=200, deadline=None)
@given(rows=call_sets())
def test_group_labels_are_the_rollout_labels_of_the_branch_that_made_them(rows: list[dict]) -> None:
    """A branch is labelled within the rollout of its earliest call: a retry is a later call of THAT rollout."""
    nodes, _, _ = build_forest(pa.Table.from_pylist(rows), run_id="R", iteration=0)
    trees = _trees(nodes)
    members = _in_tree(rows)
    group = trees.get("group:g", [])
    through = _paths(group, members)  # rows are rollout-major in rank order: r0's calls, then r1's, ...
    for x in (n for n in group if n["branch_cause"] is not None):
        on_x = [(c, path) for c, path in through if x["node_id"] in path]
        first = min(on_x, key=lambda cp: (cp[0]["rollout_id"], cp[0]["seq"], cp[0]["choice_index"]))[0]
        rid = first["rollout_id"]
        own = trees[f"rollout:{rid}"]
        seq = first["prompt_token_ids"] + (first["completion_token_ids"] if first["status"] == "ok" else [])
        at_d = [own[i] for i in locate(own, seq) or [] if own[i]["depth"] == x["depth"]]
        want = at_d[0]["branch_cause"] if at_d and at_d[0]["branch_cause"] else "rollout"
        assert x["branch_cause"] == want, (x, first["call_id"])
        # and what the label claims holds within that rollout, for the labels that name calls
        sibs = {n["node_id"] for n in group if n["parent_id"] == x["parent_id"] and n["node_id"] != x["node_id"]}
        on_sibs = [c for c, path in through if sibs & set(path) and c["rollout_id"] == rid]
        if want == "retry":
            assert any(c["seq"] < first["seq"] for c in on_sibs)
        elif want == "choice":
            assert any(c["call_id"] == first["call_id"] for c in on_sibs)
        elif want == "drift":
            earlier = {c["call_id"]: c for c in rows if c["rollout_id"] == rid}
            assert earlier[x["drift_call_id"]]["seq"] < first["seq"]
