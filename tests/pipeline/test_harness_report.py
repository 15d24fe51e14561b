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


def test_the_lakes_figures_count_training_rollouts_their_latest_attempt_and_every_call(tmp_path: Path) -> None:
    from clawpipe import capture
    from clawpipe.lake import land
    from clawpipe.pipeline.report import harness_details
    from tests.lake import fixtures as fx

    captures = tmp_path / "captures"
    failed = capture.encode_record(  # an error call: no choices, still one call of its rollout
        fx.header(rollout_id="a0", seq=2, status="http_error", http_status=500, error="boom"),
        fx.request_body("chat", False),
        b'{"error": {"message": "boom"}}',
    )
    calls = [fx.record(rollout_id=r, seq=i) for r, i in (("a0", 0), ("a0", 1), ("a1", 0), ("b0", 0), ("e0", 0))]
    fx.write_segment(captures / "s-1.seg", [*calls, failed, fx.record(rollout_id="x0")])
    fx.write_results(
        captures,
        [
            fx.rollout_row("a0", harness="codex", reward=1.0),
            fx.rollout_row("a1", harness="codex", reward=1.0, attempt=0),
            fx.rollout_row("a1", harness="codex", reward=0.0, attempt=1),  # the latest attempt counts
            fx.rollout_row("b0", reward=0.5),
            fx.rollout_row("e0", harness="codex", eval=True),  # held-out evaluation: not a training rollout
            fx.rollout_row("x0", harness="codex", status="infra_error", reward=None),  # rerun elsewhere
        ],
    )
    lake = tmp_path / "lake"
    assert land(captures, lake).rejects == 0
    got = harness_details(lake, "run1", 0)
    per_call = {"prompt_tokens": 4, "completion_tokens": 3}  # fixtures' Completion: 4 prompt ids, 3 sampled
    assert got["codex"] == {
        "rollouts": 2,
        "reward_std": 0.5,
        "calls": 4,
        **{k: 3 * v for k, v in per_call.items()},  # the error call has no token counts
        "spliced_tokens": 0,
        "drift_branches": 0,
        "rewrite_branches": 0,
    }
    assert (got["chat-loop"]["rollouts"], got["chat-loop"]["calls"], got["chat-loop"]["prompt_tokens"]) == (1, 1, 4)
