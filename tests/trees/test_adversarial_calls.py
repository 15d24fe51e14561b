"""Call sets valid in the lake but hostile to reconstruction: sizes that expose quadratic steps, odd shapes."""

from __future__ import annotations

import time
from pathlib import Path

from clawpipe.trees import build_iteration
from tests.trees.fixtures import call, read_stats, rollout, write_lake

RUN = "run-adv"
SYS = list(range(1, 101))  # a long shared system prompt: every divergence below lies past half of it


def test_thousands_of_history_rewrites_after_a_long_shared_prompt_build_in_linear_time(tmp_path: Path) -> None:
    # Each call keeps the system prompt and replaces everything after it (no other shared prefix): 2,000
    # sibling branches under one node. Labelling compared each with all earlier siblings and all later
    # calls (cubic: about a minute here); it must stay a few seconds and label every branch a rewrite.
    n = 2000
    calls = [call(f"c{i:05d}", "r1", i, SYS + [10_000 + 10 * i + k for k in range(10)], [60_000 + i]) for i in range(n)]
    write_lake(tmp_path, RUN, 0, calls, [rollout("r1", "g", 0.5)])
    t0 = time.perf_counter()
    build_iteration(tmp_path, RUN, 0)
    seconds = time.perf_counter() - t0
    stats = read_stats(tmp_path, RUN, 0)["rollout:r1"]
    assert stats["n_calls"] == n and stats["n_leaves"] == n
    assert stats["branches_rewrite"] == n - 1 and stats["branches_subagent"] == 0
    assert seconds < 10, f"{n} rewrites took {seconds:.1f}s"
