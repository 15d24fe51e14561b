"""Call structures of multi-agent and sampling harnesses the builder has not met: sub-agents fanned out in
parallel from one system prompt, a sliding window over the history, best-of-n picked by the harness, a
continuation from the second of n choices, parallel tool calls."""

from __future__ import annotations

from pathlib import Path

from clawpipe.trees import build_iteration
from tests.trees.fixtures import call, locate, read_stats, read_tree, rollout, write_lake

CAUSES = ("retry", "choice", "rewrite", "subagent", "drift")


def _branches(stats: dict) -> dict[str, int]:
    return {c: stats[f"branches_{c}"] for c in CAUSES}


def _build(tmp_path: Path, calls: list[dict]) -> tuple[list[dict], dict]:
    write_lake(tmp_path, "run-a", 0, calls, [rollout("r1", "g", 1.0)])
    build_iteration(tmp_path, "run-a", 0)
    return read_tree(tmp_path, "run-a", 0, "rollout:r1"), read_stats(tmp_path, "run-a", 0)["rollout:r1"]


def _generated_once(nodes: list[dict], calls: list[dict]) -> None:
    for c in calls:
        path = locate(nodes, c["prompt_token_ids"] + c["completion_token_ids"])
        assert path is not None, c["call_id"]
        assert nodes[path[-1]]["generated"] and nodes[path[-1]]["call_id"] == c["call_id"]


def test_sub_agents_fanned_out_in_parallel_from_one_system_prompt_are_lineages_of_their_own(tmp_path: Path):
    sysp = list(range(1, 30))  # the sub-agents' shared system prompt
    calls = [call("p0", "r1", 0, [*range(200, 230)], [40, 41, 42])]  # the parent, which spawns three
    briefs = {k: [60 + 5 * k, 61 + 5 * k, 62 + 5 * k] for k in range(3)}
    answers = {k: [[70 + k, 71, 72], [80 + k, 81]] for k in range(3)}
    seq = 1
    for turn in range(2):  # interleaved as they run at once: a0 b0 c0 a1 b1 c1
        for k in range(3):
            prompt = [*sysp, *briefs[k]]
            if turn:
                prompt += [*answers[k][0], 90, 91 + k]  # the tool result of its own
            calls.append(call(f"s{k}.{turn}", "r1", seq, prompt, answers[k][turn]))
            seq += 1
    calls.append(call("p1", "r1", seq, [*range(200, 230), 40, 41, 42, 95, 96], [43]))  # the parent reads them
    nodes, stats = _build(tmp_path, calls)
    _generated_once(nodes, calls)
    # four lineages: the parent's, and one per sub-agent; the system prompt is one shared node
    assert stats["n_leaves"] == 4
    assert _branches(stats) == {**dict.fromkeys(CAUSES, 0), "subagent": 3}
    shared = nodes[locate(nodes, sysp)[-1]]
    assert shared["n_seqs"] == 6 and shared["token_ids"] == sysp
    # each sub-agent's second turn continues its first, never another's
    for k in range(3):
        first = locate(nodes, [*sysp, *briefs[k], *answers[k][0]])
        second = locate(nodes, [*sysp, *briefs[k], *answers[k][0], 90, 91 + k, *answers[k][1]])
        assert first is not None and second is not None and second[: len(first)] == first


def test_a_sliding_window_that_drops_the_oldest_exchange_branches_as_a_rewrite(tmp_path: Path):
    sysp, task = [1, 2, 3, 4, 5], [10, 11, 12]
    ex = [([20 + 3 * t, 21 + 3 * t], [100 + t, 101 + t, 102 + t]) for t in range(4)]  # (answer, tool result)
    calls = []
    for t in range(4):
        window = ex[max(0, t - 2) : t]  # the last two exchanges only
        prompt = [*sysp, *task]
        for a, r in window:
            prompt += [*a, *r]
        calls.append(call(f"c{t}", "r1", t, prompt, ex[t][0]))
    nodes, stats = _build(tmp_path, calls)
    _generated_once(nodes, calls)
    # turns 0-2 are one path; turn 3 drops the first exchange: the same lineage with its history edited
    assert _branches(stats) == {**dict.fromkeys(CAUSES, 0), "rewrite": 1}
    branch = nodes[locate(nodes, calls[3]["prompt_token_ids"])[-2]]
    assert branch["depth"] + len(branch["token_ids"]) == len(sysp) + len(task)


def test_best_of_n_sampled_one_at_a_time_then_continued_from_the_chosen_one(tmp_path: Path):
    prompt = list(range(1, 20))
    answers = [[30, 31], [40, 41], [50, 51]]
    calls = [call(f"try{k}", "r1", k, prompt, answers[k]) for k in range(3)]
    calls.append(call("next", "r1", 3, [*prompt, *answers[1], 60, 61], [70, 71]))  # the harness kept try1
    nodes, stats = _build(tmp_path, calls)
    _generated_once(nodes, calls)
    assert _branches(stats) == {**dict.fromkeys(CAUSES, 0), "retry": 2}
    kept = locate(nodes, [*prompt, *answers[1]])
    cont = locate(nodes, [*prompt, *answers[1], 60, 61, 70, 71])
    assert kept is not None and cont is not None and cont[: len(kept)] == kept
    assert stats["n_leaves"] == 3


def test_a_continuation_from_the_second_of_n_choices_hangs_under_that_choice(tmp_path: Path):
    prompt = list(range(1, 20))
    calls = [
        call("c0", "r1", 0, prompt, [30, 31, 32], choice=0),
        call("c0", "r1", 0, prompt, [30, 35, 36], choice=1),  # shares its first token with choice 0
        call("c1", "r1", 1, [*prompt, 30, 35, 36, 60], [70]),
    ]
    nodes, stats = _build(tmp_path, calls)
    _generated_once(nodes, calls)
    assert _branches(stats) == {**dict.fromkeys(CAUSES, 0), "choice": 1}
    first = nodes[locate(nodes, [*prompt, 30])[-1]]
    assert first["generated"]  # a shared sampled token is trained once, for both choices
    cont = locate(nodes, [*prompt, 30, 35, 36, 60, 70])
    assert cont is not None and nodes[cont[-1]]["call_id"] == "c1" and stats["n_leaves"] == 2


def test_parallel_tool_calls_answered_together_stay_one_path(tmp_path: Path):
    prompt = list(range(1, 20))
    two_calls = [500, 501, 502, 503, 504, 505]  # one answer holding two tool calls
    results = [600, 601, 602, 603]  # both results, one after the other
    calls = [
        call("c0", "r1", 0, prompt, two_calls),
        call("c1", "r1", 1, [*prompt, *two_calls, *results], [700, 701]),
    ]
    nodes, stats = _build(tmp_path, calls)
    _generated_once(nodes, calls)
    assert _branches(stats) == dict.fromkeys(CAUSES, 0) and stats["n_leaves"] == 1
