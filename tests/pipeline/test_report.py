"""What a run reports: honest first-vs-last figures, plain status names, and config hand-off to children."""

from __future__ import annotations

from pathlib import Path

import pytest

from clawpipe.configfile import read_config, write_config
from clawpipe.errors import ConfigError
from clawpipe.pipeline.config import PipelineConfig, load_config
from clawpipe.pipeline.report import change, final_summary, iteration_metrics, iteration_summary
from clawpipe.pipeline.stages import summarize_results
from clawpipe.pipeline.state import RunState
from clawpipe.schemas import RolloutStatus


def _summary(iteration: int, reward: float) -> dict:
    rollouts = {"reward_mean": reward, "by_harness": {"chat-loop": {"n": 4, "reward_mean": reward}}, "statuses": {}}
    return iteration_summary(
        iteration,
        rollouts=rollouts,
        trees={"n_trees": 2},
        trained={"checkpoint": f"/ckpt/v{iteration + 1}", "metrics": {"loss/total": 0.5, "step/seconds": 1.0}},
        policy_version=iteration + 1,
        evaluation=None,
        seconds=1.234,
    )


def test_a_zero_first_reward_is_reported_as_a_difference_not_infinity() -> None:
    state = RunState(run_id="r", config={}, policy_dir="/p")
    for i, reward in enumerate([0.0, 0.1, 0.2]):
        state.complete(_summary(i, reward), peak_memory_mb=10.0)
    md = final_summary(state, 5.0)["markdown"]
    assert "inf" not in md
    assert "first 0.000 -> last 0.200 (+0.200;" in md
    assert change(0.1, 0.2) == "x2.00"


def test_statuses_are_counted_by_their_plain_names() -> None:
    rows = [
        {"harness": "a", "status": RolloutStatus.succeeded, "reward": 1.0},
        {"harness": "a", "status": RolloutStatus.succeeded, "reward": 0.0},
        {"harness": "a", "status": "timeout", "reward": None},
    ]
    statuses = summarize_results(rows)["statuses"]
    assert statuses == {"succeeded": 2, "timeout": 1}
    assert all(type(k) is str for k in statuses)
    assert "RolloutStatus" not in str(statuses)


def test_iteration_metrics_hold_reward_per_harness_and_only_training_metrics_are_kept() -> None:
    summary = _summary(0, 0.25)
    assert summary["train"] == {"loss/total": 0.5}
    assert summary["seconds"] == 1.2
    assert iteration_metrics(summary) == {"reward/mean": 0.25, "iteration/seconds": 1.2, "reward/chat-loop": 0.25}


def test_a_config_handed_to_a_child_reads_back_equal(tmp_path: Path) -> None:
    cfg = load_config(iterations=3, backend="process")
    path = write_config(cfg, tmp_path / "run" / "config.json")
    assert read_config(PipelineConfig, path) == cfg
    path.write_text('{"iterations": 0}')
    with pytest.raises(ConfigError, match="iterations"):
        read_config(PipelineConfig, path)


def test_evaluation_runs_greedy_and_sampled_groups_and_reports_each() -> None:
    from clawpipe.pipeline.stages import sample_specs

    cfg = load_config(eval_tasks=2, eval_samples=3)
    specs = sample_specs(cfg, "r", 4, policy_version=1, evaluation=True)
    per_harness = 2 * (1 + 3)
    assert len(specs) == per_harness * len(cfg.harnesses)
    assert all(s.eval for s in specs)
    greedy = [s for s in specs if s.group_id.startswith("eval.greedy.")]
    sampled = [s for s in specs if s.group_id.startswith("eval.sampled.")]
    assert {s.task["sampling"]["temperature"] for s in greedy} == {0.0}
    assert all(s.task.get("sampling", {}).get("temperature") != 0.0 for s in sampled)
    assert len({s.id for s in specs}) == len(specs)
    rows = [
        {"harness": s.harness, "status": "succeeded", "reward": 1.0 if s in greedy else 0.5, "group_id": s.group_id}
        for s in specs
    ]
    summary = iteration_summary(
        0,
        rollouts={"reward_mean": 0.1, "by_harness": {}, "statuses": {}},
        trees={},
        trained={"checkpoint": "/c"},
        policy_version=1,
        evaluation=summarize_results(rows),
        seconds=1.0,
    )
    assert summary["eval_reward_mean"] == 1.0 and summary["eval_sampled_reward_mean"] == 0.5
    assert iteration_metrics(summary)["eval/reward_sampled"] == 0.5


@pytest.mark.parametrize(("age", "said"), [(1, "1 version behind"), (2, "2 versions behind"), (0, "0 versions behind")])
def test_the_async_line_says_how_far_behind_in_plain_words(age: int, said: str) -> None:
    state = RunState(run_id="r", config={}, policy_dir="/p")
    s = _summary(0, 0.1)
    s["overlap"] = {"max_age": age, "dropped_calls": 3, "trainer_wait_s": 2.0}
    state.complete(s, peak_memory_mb=10.0)
    md = final_summary(state, 5.0)["markdown"]
    assert f"async: oldest trained call {said}, 3 stale calls dropped" in md


def test_a_tiny_reward_spread_in_the_lake_is_reported_not_rounded_away(tmp_path: Path) -> None:
    """Two rollouts of a harness whose rewards differ by 1.2e-5 (a real run's claude-code pair) keep a std > 0
    in the per-harness figures: rounded to 4 places it read as 0, no learning signal, where there was one."""
    from clawpipe.lake import land
    from clawpipe.pipeline.report import harness_details
    from tests.lake import fixtures as fx

    cap = tmp_path / "cap"
    rewards = [0.01556420233463035, 0.01557632398753894]
    fx.write_segment(cap / "s.seg", [fx.record(rollout_id=f"r{k}", call_id=f"c{k}") for k in range(2)])
    fx.write_results(cap, [fx.rollout_row(f"r{k}", reward=r) for k, r in enumerate(rewards)])
    land(cap, tmp_path / "lake")
    got = harness_details(tmp_path / "lake", "run1", 0)
    (figures,) = got.values()
    assert figures["rollouts"] == 2
    assert figures["reward_std"] == pytest.approx(abs(rewards[1] - rewards[0]) / 2, rel=1e-6)
