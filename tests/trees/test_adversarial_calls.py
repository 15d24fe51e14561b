"""Call sets valid in the lake but hostile to reconstruction: sizes that expose quadratic steps, odd shapes."""

from __future__ import annotations

import time
from pathlib import Path

from clawpipe.trees import build_iteration
from tests.trees.fixtures import call, read_stats, read_tree, rollout, write_lake

RUN = "run-adv"
SYS = list(range(1, 101))  # a long shared system prompt: every divergence below lies past half of it


def test_thousands_of_history_rewrites_after_a_long_shared_prompt_build_in_linear_time(tmp_path: Path) -> None:
    # Each call keeps the system prompt and replaces everything after it (no other shared prefix): 2,000
    # sibling branches under one node. Labelling compared each with all earlier siblings and all later
    # calls (cubic: about a minute here); it must stay a few seconds and label every branch a rewrite.
    n = 2000
    calls = [call(f"c{i:05d}", "r1", i, SYS + [10_000 + 10 * i + k for k in range(10)], [60_000 + i]) for i in range(n)]
    write_lake(tmp_path, RUN, 0, calls, [rollout("r1", "g", 0.5)])
    t0 = time.process_time()  # CPU seconds: machine load does not count
    build_iteration(tmp_path, RUN, 0)
    seconds = time.process_time() - t0
    stats = read_stats(tmp_path, RUN, 0)["rollout:r1"]
    assert stats["n_calls"] == n and stats["n_leaves"] == n
    assert stats["branches_rewrite"] == n - 1 and stats["branches_subagent"] == 0
    assert seconds < 10, f"{n} rewrites took {seconds:.1f} CPU s"


def test_a_repetitive_completion_re_encoded_in_the_next_prompt_labels_in_linear_time(tmp_path: Path) -> None:
    # An untrained policy repeats one id 200,000 times; the harness replays it re-encoded (runs of the id
    # merged differently), so the next prompt leaves the completion at its first token. Looking for a tail
    # of the completion that the prompt resumes with compared every repeated position in full (quadratic:
    # about 3.5 s per such branch here); three rollouts of it must label in well under that.
    n = 200_000
    calls, rollouts = [], []
    for r in range(3):
        head = [1, 2, 3, 50 + r]
        calls += [
            call(f"r{r}-c0", f"r{r}", 0, head, [8] + [7] * n),
            call(f"r{r}-c1", f"r{r}", 1, head + [7, 9] + [7] * n + [5], [11, 12]),
        ]
        rollouts.append(rollout(f"r{r}", "g", 0.5, sample_idx=r))
    write_lake(tmp_path, RUN, 0, calls, rollouts)
    t0 = time.process_time()  # CPU seconds: machine load does not count
    build_iteration(tmp_path, RUN, 0)
    seconds = time.process_time() - t0
    stats = read_stats(tmp_path, RUN, 0)
    for r in range(3):
        s = stats[f"rollout:r{r}"]
        assert s["n_leaves"] == 2 and s["branches_rewrite"] + s["branches_drift"] == 1
    assert seconds < 3, f"three repetitive re-encodings took {seconds:.1f} CPU s"


def test_a_leaf_shared_by_rollouts_with_rewards_near_the_float64_limit_keeps_their_mean(tmp_path: Path) -> None:
    # Two rollouts of a group send the same call and get the same answer: one leaf with both rewards.
    # Each reward is finite (landing accepts it); their sum is not, and the leaf must not say inf.
    big = 1.7e308
    calls = [call("a", "r1", 0, SYS, [500, 501]), call("b", "r2", 0, SYS, [500, 501])]
    write_lake(tmp_path, RUN, 0, calls, [rollout("r1", "g", big), rollout("r2", "g", big, sample_idx=1)])
    build_iteration(tmp_path, RUN, 0)
    leaves = [n for n in read_tree(tmp_path, RUN, 0, "group:g") if n["is_leaf"]]
    assert len(leaves) == 1 and leaves[0]["rollout_ids"] == ["r1", "r2"]
    assert leaves[0]["reward"] == big
