"""Trees of harness histories the builder has not met, from landed Anthropic Messages captures whose prompt ids
are the rendered conversation (tests/apis/captures.py): a system prompt whose timestamp changes every turn,
history compaction, tool results truncated when sent again, a sub-agent interleaved with its parent, a retry."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clawpipe import capture
from clawpipe.trees import build_iteration
from tests.apis import captures as cx
from tests.lake import fixtures as fx
from tests.trees.fixtures import call, locate, read_stats, read_tree, rollout, write_lake

TOOLS = [{"name": "read", "description": "read a file", "input_schema": {"type": "object"}}]
TASK = "Fix the failing test in tests/test_x.py."
CAUSES = ("retry", "choice", "rewrite", "subagent", "drift")


class Harness:
    """Calls of one rollout: each request, the answer the engine gives it, landed as one segment."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.seqs: list[tuple[list[int], list[int]]] = []  # (prompt ids, completion ids) per call

    def call(self, request: dict[str, Any], content: list[dict[str, Any]], *, rollout: str = "r0") -> dict[str, Any]:
        """Send ``request``; the engine answers ``content``. Returns the assistant message to send back."""
        n = len(self.frames)
        body, completion = cx.messages_answer(request, content, rid=f"msg_{n}")
        self.frames.append(
            cx.record("messages", request, body, stream=False, seq=n, call_id=f"call{n}", rollout_id=rollout)
        )
        self.seqs.append((cx.prompt_ids("messages", request), completion))
        return {"role": "assistant", "content": content}

    def land_and_build(self, tmp_path: Path, rollouts: tuple[str, ...] = ("r0",)) -> Path:
        lake = cx.land_frames(tmp_path, self.frames, [{"rollout_id": r, "reward": 1.0} for r in rollouts])
        assert cx.rejects(lake) == []
        build_iteration(lake, cx.RUN, 0)
        return lake


def _read(n: int) -> list[dict[str, Any]]:
    return [{"type": "tool_use", "id": f"toolu_{n}", "name": "read", "input": {"path": f"f{n}.py"}}]


def _result(n: int, text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{n}", "content": text}]}


def _text(text: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text}]


def _branches(stats: dict[str, Any]) -> dict[str, int]:
    return {c: stats[f"branches_{c}"] for c in CAUSES}


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _system(turn: int, *, leading: bool = False) -> str:
    stamp = f"2026-12-02T04:{10 + turn:02d}:00Z"
    if leading:  # epoch seconds first: the very first token differs
        return f"{1_764_648_600 + 60 * turn} You are a coding agent. Be careful."
    return f"You are a coding agent. Current time: {stamp}. Be careful."


def _timestamped_rollout(h: Harness, *, leading: bool) -> None:
    history: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    for turn in range(3):
        req = {"model": "claude-x", "system": _system(turn, leading=leading), "messages": history, "tools": TOOLS}
        answer = h.call(req, _read(turn) if turn < 2 else _text("Fixed."))
        history = [*history, answer, _result(turn, f"contents of f{turn}")]


def test_a_system_prompt_whose_timestamp_changes_every_turn_branches_there_as_a_rewrite(tmp_path: Path) -> None:
    h = Harness()
    _timestamped_rollout(h, leading=False)
    lake = h.land_and_build(tmp_path)
    stats = read_stats(lake, cx.RUN, 0)["rollout:r0"]
    nodes = read_tree(lake, cx.RUN, 0, "rollout:r0")
    shared = _common(h.seqs[0][0], h.seqs[1][0])
    prefix = cx.ids("<system>You are a coding agent. Current time: 2026-12-02T04:")
    assert shared == len(prefix) and h.seqs[0][0][:shared] == prefix
    # one shared node up to the timestamp's differing digit, then one branch per turn: the edited system
    # prompt replays the earlier turns as context (the old lineage stops), a rewrite, not a sub-agent
    (root,) = [n for n in nodes if n["parent_id"] == -1]
    assert root["token_ids"] == prefix and root["n_seqs"] == 3
    kids = [n for n in nodes if n["parent_id"] == root["node_id"]]
    assert len(kids) == 3 and [n["depth"] for n in kids] == [shared] * 3
    assert _branches(stats) == {**dict.fromkeys(CAUSES, 0), "rewrite": 2}
    # every call's completion is trained once, on its own branch
    for i, (prompt, completion) in enumerate(h.seqs):
        path = locate(nodes, prompt + completion)
        assert path is not None and nodes[path[-1]]["generated"] and nodes[path[-1]]["call_id"] == f"call{i}"
        assert [nodes[j]["generated"] for j in path] == [False, False, True]
    assert stats["n_leaves"] == 3 and stats["unique_tokens"] == stats["flattened_tokens"] - 2 * shared


def test_a_prompt_starting_with_a_changing_timestamp_shares_no_prefix_and_still_builds(tmp_path: Path) -> None:
    """A raw completions harness whose prompt starts with the time: no token is shared between its calls."""
    frames, seqs = [], []
    history = ""
    for turn in range(3):
        prompt = f"{_system(turn, leading=True)}\n{TASK}\n{history}Assistant:"
        answer = f" step {turn}\n"
        p, g = cx.ids(prompt), cx.ids(answer)
        c = fx.Completion(prompt_ids=p, ids=g, logprobs=[-0.5] * len(g), pieces=["t"] * len(g))
        frames.append(
            capture.encode_record(
                fx.header(api="completions", run_id=cx.RUN, seq=turn, call_id=f"call{turn}"),
                json.dumps({"model": "m", "prompt": prompt}).encode(),
                fx.response_body("completions", False, c),
            )
        )
        seqs.append((p, g))
        history += f"Assistant:{answer}"
    lake = cx.land_frames(tmp_path, frames, [{"rollout_id": "r0", "reward": 1.0}])
    assert cx.rejects(lake) == []
    build_iteration(lake, cx.RUN, 0)
    stats = read_stats(lake, cx.RUN, 0)["rollout:r0"]
    nodes = read_tree(lake, cx.RUN, 0, "rollout:r0")
    assert _common(seqs[0][0], seqs[1][0]) == 0
    roots = [n for n in nodes if n["parent_id"] == -1]
    assert len(roots) == 3 and all(n["depth"] == 0 and not n["generated"] for n in roots)
    assert _branches(stats) == {**dict.fromkeys(CAUSES, 0), "rewrite": 2}
    assert stats["unique_tokens"] == stats["flattened_tokens"] and stats["n_leaves"] == 3
    for i, (p, g) in enumerate(seqs):
        path = locate(nodes, p + g)
        assert path is not None and [nodes[j]["generated"] for j in path] == [False, True]
        assert nodes[path[-1]]["call_id"] == f"call{i}"


def test_history_compaction_replaces_earlier_turns_with_a_summary_as_a_rewrite(tmp_path: Path) -> None:
    h = Harness()
    system = "You are a coding agent."
    history: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    for turn in range(2):
        answer = h.call({"model": "claude-x", "system": system, "messages": history, "tools": TOOLS}, _read(turn))
        history = [*history, answer, _result(turn, f"contents of f{turn}")]
    summary = {"role": "user", "content": "Summary of the work so far: read f0.py and f1.py."}
    compacted = [{"role": "user", "content": TASK}, {"role": "assistant", "content": "ok"}, summary]
    h.call({"model": "claude-x", "system": system, "messages": compacted, "tools": TOOLS}, _text("Fixed."))
    lake = h.land_and_build(tmp_path)
    stats = read_stats(lake, cx.RUN, 0)["rollout:r0"]
    nodes = read_tree(lake, cx.RUN, 0, "rollout:r0")
    (p0, g0), (p1, _g1), (p2, g2) = h.seqs
    assert p1[: len(p0 + g0)] == p0 + g0  # turns one and two: one path
    assert _common(p2, p0 + g0) == len(p0)  # the compacted prompt leaves turn one's answer at its start
    branch = nodes[locate(nodes, p2)[-1]]
    assert branch["depth"] == len(p0) and branch["branch_cause"] == "rewrite"
    assert _branches(stats) == {**dict.fromkeys(CAUSES, 0), "rewrite": 1}
    assert nodes[locate(nodes, p2 + g2)[-1]]["generated"]


def test_a_tool_result_truncated_on_resend_branches_inside_the_result_as_a_rewrite(tmp_path: Path) -> None:
    h = Harness()
    system = "You are a coding agent."
    long = "line\n" * 40
    history: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    answer = h.call({"model": "claude-x", "system": system, "messages": history, "tools": TOOLS}, _read(0))
    history = [*history, answer, _result(0, long)]
    answer = h.call({"model": "claude-x", "system": system, "messages": history, "tools": TOOLS}, _read(1))
    # the harness resends the first result cut to its head, then the new result
    cut = [*history[:2], _result(0, "line\n" * 3 + "[... 37 lines truncated]"), answer, _result(1, "x = 1")]
    h.call({"model": "claude-x", "system": system, "messages": cut, "tools": TOOLS}, _text("Fixed."))
    lake = h.land_and_build(tmp_path)
    stats = read_stats(lake, cx.RUN, 0)["rollout:r0"]
    nodes = read_tree(lake, cx.RUN, 0, "rollout:r0")
    (p0, g0), (p1, g1), (p2, _g2) = h.seqs
    d = _common(p1, p2)
    assert len(p0 + g0) < d < len(p1)  # inside the first tool result, after turn one's answer
    branch = nodes[locate(nodes, p2)[-1]]
    assert branch["depth"] == d and branch["branch_cause"] == "rewrite"
    # turn two's answer is generated on the old branch; the new prompt replays it as context
    g1_node = nodes[locate(nodes, p1 + g1)[-1]]
    assert g1_node["generated"] and g1_node["call_id"] == "call1" and g1_node["n_seqs"] == 1
    assert _branches(stats) == {**dict.fromkeys(CAUSES, 0), "rewrite": 1}


def test_a_sub_agent_interleaved_with_its_parent_is_its_own_lineage(tmp_path: Path) -> None:
    h = Harness()
    parent_sys, child_sys = "You are a coding agent.", "You are a search sub-agent."
    parent: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    child: list[dict[str, Any]] = [{"role": "user", "content": "Find where x is defined."}]
    answer = h.call({"model": "claude-x", "system": parent_sys, "messages": parent, "tools": TOOLS}, _read(0))
    parent = [*parent, answer, _result(0, "see x")]
    answer = h.call({"model": "claude-x", "system": child_sys, "messages": child, "tools": TOOLS}, _read(1))
    child = [*child, answer, _result(1, "x.py:1")]
    answer = h.call({"model": "claude-x", "system": parent_sys, "messages": parent, "tools": TOOLS}, _read(2))
    h.call({"model": "claude-x", "system": child_sys, "messages": child, "tools": TOOLS}, _text("x.py line 1"))
    lake = h.land_and_build(tmp_path)
    stats = read_stats(lake, cx.RUN, 0)["rollout:r0"]
    nodes = read_tree(lake, cx.RUN, 0, "rollout:r0")
    (p0, g0), (p1, g1), (p2, _g2), (p3, _g3) = h.seqs
    assert p2[: len(p0 + g0)] == p0 + g0 and p3[: len(p1 + g1)] == p1 + g1
    d = _common(p0, p1)
    branch = nodes[locate(nodes, p1)[-1]]
    assert branch["depth"] == d and branch["branch_cause"] == "subagent"
    assert _branches(stats) == {**dict.fromkeys(CAUSES, 0), "subagent": 1}
    for prompt, completion in h.seqs:
        assert nodes[locate(nodes, prompt + completion)[-1]]["generated"]
    assert stats["n_leaves"] == 2


def test_the_same_prompt_sent_twice_with_different_answers_is_a_retry(tmp_path: Path) -> None:
    h = Harness()
    req = {"model": "claude-x", "system": "You are a coding agent.", "messages": [{"role": "user", "content": TASK}]}
    h.call(req, _text("First try."))
    h.call(req, _text("Second try."))
    lake = h.land_and_build(tmp_path)
    stats = read_stats(lake, cx.RUN, 0)["rollout:r0"]
    nodes = read_tree(lake, cx.RUN, 0, "rollout:r0")
    (p0, g0), (p1, g1) = h.seqs
    assert p0 == p1
    prompt_node = nodes[locate(nodes, p0)[-1]]
    a, b = (nodes[locate(nodes, p0 + g)[-1]] for g in (g0, g1))
    assert a["parent_id"] == b["parent_id"] == prompt_node["node_id"] and not prompt_node["generated"]
    assert (a["call_id"], b["call_id"]) == ("call0", "call1") and b["branch_cause"] == "retry"
    assert _branches(stats) == {**dict.fromkeys(CAUSES, 0), "retry": 1}


def test_a_group_of_timestamped_rollouts_shares_the_prompt_up_to_the_time_and_keeps_each_rollout_s_labels(
    tmp_path: Path,
) -> None:
    h = Harness()
    for r, minute in (("ra", 0), ("rb", 30)):
        history: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
        for turn in range(2):
            system = f"You are a coding agent. Current time: 2026-12-02T05:{minute + turn:02d}:00Z."
            answer = h.call({"model": "claude-x", "system": system, "messages": history}, _read(turn), rollout=r)
            history = [*history, answer, _result(turn, "ok")]
    lake = cx.land_frames(
        tmp_path, h.frames, [{"rollout_id": r, "group_id": "g", "reward": w} for r, w in (("ra", 1.0), ("rb", 0.0))]
    )
    build_iteration(lake, cx.RUN, 0)
    stats = read_stats(lake, cx.RUN, 0)
    nodes = read_tree(lake, cx.RUN, 0, "group:g")
    prefix = cx.ids("<system>You are a coding agent. Current time: 2026-12-02T05:")
    (root,) = [n for n in nodes if n["parent_id"] == -1]
    assert root["token_ids"] == prefix and root["n_seqs"] == 4 and root["rollout_ids"] == ["ra", "rb"]
    for r in ("ra", "rb"):
        assert _branches(stats[f"rollout:{r}"]) == {**dict.fromkeys(CAUSES, 0), "rewrite": 1}
    group = stats["group:g"]
    assert (group["branches_rewrite"], group["branches_rollout"], group["n_leaves"]) == (2, 1, 4)
    leaves = {n["call_id"]: n["reward"] for n in nodes if n["is_leaf"]}
    assert leaves == {"call0": 1.0, "call1": 1.0, "call2": 0.0, "call3": 0.0}


def test_a_side_call_whose_prompt_happens_to_hold_the_last_short_answer_is_still_a_sub_agent(tmp_path: Path) -> None:
    """The previous answer alone (one common id, say an end-of-turn token) proves nothing: the lineage carries
    on only where the prompt also replays what led up to that answer."""
    system, task = [1, 2, 3, 4], [5, 6, 7]
    calls = [
        call("c1", "r1", 0, [*system, *task], [20, 9]),
        call("c2", "r1", 1, [*system, *task, 20, 9, 8], [9]),  # an answer of one id
        call("t1", "r1", 2, [1, 90, 91, 9, 92], [31]),  # a side call with its own system prompt
    ]
    write_lake(tmp_path, "run-a", 0, calls, [rollout("r1", "g", 1.0)])
    build_iteration(tmp_path, "run-a", 0)
    stats = read_stats(tmp_path, "run-a", 0)["rollout:r1"]
    assert _branches(stats) == {**dict.fromkeys(CAUSES, 0), "subagent": 1}


def test_a_side_call_quoting_the_conversation_after_instructions_of_its_own_is_a_sub_agent(tmp_path: Path) -> None:
    """A memory extractor's prompt: its own long instructions, then the conversation so far quoted whole (the
    end of the last prompt and its answer included). The replay sits far from where the conversation had it,
    so this is another lineage, unlike a timestamp edited in front, which moves the replay by a few ids."""
    system, task = [1, 2, 3, 4], list(range(100, 140))
    answer = [20, 21, 22]
    instructions = list(range(300, 380))  # 80 ids of the extractor's own
    calls = [
        call("c1", "r1", 0, [*system, *task], answer),
        call("m1", "r1", 1, [1, *instructions, *system[1:], *task, *answer, 8], [31, 32]),
    ]
    write_lake(tmp_path, "run-a", 0, calls, [rollout("r1", "g", 1.0)])
    build_iteration(tmp_path, "run-a", 0)
    stats = read_stats(tmp_path, "run-a", 0)["rollout:r1"]
    assert _branches(stats) == {**dict.fromkeys(CAUSES, 0), "subagent": 1}
    # the same conversation with a 3-id timestamp edited in at the start stays one lineage: a rewrite
    edited = [
        call("c1", "r2", 0, [*system, *task], answer),
        call("c2", "r2", 1, [1, 50, 51, 52, *system[1:], *task, *answer, 8], [31]),
    ]
    write_lake(tmp_path, "run-b", 0, edited, [rollout("r2", "g", 1.0)])
    build_iteration(tmp_path, "run-b", 0)
    stats = read_stats(tmp_path, "run-b", 0)["rollout:r2"]
    assert _branches(stats) == {**dict.fromkeys(CAUSES, 0), "rewrite": 1}
