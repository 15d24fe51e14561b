"""The run summary per harness: the lake's figures merged into an iteration, pooled over the run, and a lake
that cannot be read costing the figures, never the iteration. (Against a real run's lake:
tests/cli_harnesses/test_mix_pipeline.py.)"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path

import pytest

from clawpipe.pipeline.report import iteration_metrics, iteration_summary, reward_rows, run_harness_table
from clawpipe.tables import partition_dir


def _summary(lake: Path, **figures: float) -> dict:
    return iteration_summary(
        0,
        rollouts={"reward_mean": 0.5, "by_harness": {"codex": {"n": 2, "reward_mean": 0.5}}, "statuses": {}},
        trees={"run_id": "r1", "iteration": 0, "n_trees": 2},
        trained={"checkpoint": "/c", "metrics": {"sequences/codex": 3.0, "reward/std/codex": 0.5}},
        policy_version=1,
        evaluation=None,
        seconds=1.0,
        lake_dir=lake,
    )


def test_an_empty_lake_gives_no_figures_but_the_step_sequences(tmp_path: Path) -> None:
    s = _summary(tmp_path / "lake")
    assert s["by_harness"] == {"codex": {"n": 2, "reward_mean": 0.5, "trained_sequences": 3}}
    assert s["train"]["sequences/codex"] == 3.0
    assert iteration_metrics(s)["harness/codex/trained_sequences"] == 3.0
    assert reward_rows(s) == [{"harness": "codex", "rollouts": 2, "reward_mean": 0.5, "trained_sequences": 3}]


def test_an_unreadable_lake_leaves_the_figures_out_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lake = tmp_path / "lake"
    bad = partition_dir(lake, "model_calls", "r1", 0) / "part-0.parquet"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not parquet at all")
    with caplog.at_level(logging.WARNING, logger="clawpipe.pipeline.report"):
        s = _summary(lake)
    assert s["by_harness"]["codex"] == {"n": 2, "reward_mean": 0.5, "trained_sequences": 3}
    assert "per-harness figures of r1 iteration 0 left out" in caplog.text


def test_the_run_table_sums_figures_and_pools_the_reward_spread() -> None:
    rewards = {0: [0.1, 0.3], 1: [0.6, 1.0]}
    its = []
    for i, rs in rewards.items():
        figures = {"calls": 4 + i, "prompt_tokens": 1000, "completion_tokens": 50, "drift_branches": i}
        entry = {"n": 2, "reward_mean": statistics.fmean(rs), "reward_std": statistics.pstdev(rs), **figures}
        its.append({"by_harness": {"qwen-code": {**entry, "spliced_tokens": 7, "trained_sequences": 2}}})
    table = run_harness_table(its)
    row = next(line for line in table.splitlines() if line.startswith("| qwen-code |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    every = rewards[0] + rewards[1]
    assert cells[1:] == [
        "4",
        f"{statistics.fmean(every):.3f}",
        f"{statistics.pstdev(every):.3f}",
        "9",
        "2000",
        "100",
        "1",
        "14",
        "4",
    ]
    assert run_harness_table([{"by_harness": {"codex": {"n": 2, "reward_mean": 0.5}}}]) == ""
