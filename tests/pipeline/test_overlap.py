"""The async loop's bookkeeping without Prefect: the producer's gate, the staleness record of a step and the
MLflow metrics it becomes, and the lake reads the trainer waits on (a real lake written by landing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from clawpipe.errors import ClawpipeError, ConfigError
from clawpipe.pipeline import overlap as ov
from clawpipe.pipeline.config import PipelineConfig, load_config
from clawpipe.pipeline.report import iteration_metrics
from clawpipe.pipeline.state import RunState


def _cfg(**kw: object) -> PipelineConfig:
    return PipelineConfig(mode="async", groups=2, samples=2, **kw)  # type: ignore[arg-type]


def test_async_mode_and_staleness_are_validated() -> None:
    assert PipelineConfig().mode == "sync"
    with pytest.raises(ConfigError, match="mode"):
        load_config(None, mode="later")
    with pytest.raises(ConfigError, match="max_staleness"):
        load_config(None, max_staleness=-1)


@pytest.mark.parametrize(("staleness", "ahead"), [(0, 1), (1, 1), (3, 3)])
def test_producer_runs_at_most_lookahead_batches_ahead(staleness: int, ahead: int) -> None:
    state = RunState(run_id="r", config={}, policy_dir="/p")
    shared = ov.Overlap(cfg=_cfg(max_staleness=staleness), state=state)
    assert [b for b in range(8) if shared.may_start(b)] == list(range(ahead + 1))
    shared.published(1, 1)  # step 0's policy is live (its evaluation may still run)
    assert [b for b in range(8) if shared.may_start(b)] == list(range(ahead + 2))
    assert shared.policy_version == 1
    state.completed.append({"policy_version": 1})  # a resumed run starts from the saved state
    assert ov.Overlap(cfg=shared.cfg, state=state).trained == 1


def test_next_step_trains_from_the_policy_published_last() -> None:
    state = RunState(run_id="r", config={}, policy_dir="/p/v0", mlflow_run_id="m")
    shared = ov.Overlap(cfg=_cfg(), state=state)
    assert shared.position() == {"policy_dir": "/p/v0", "policy_version": 0, "mlflow_run_id": "m"}
    shared.published(1, 1, "/p/v1")  # step 0 published; its evaluation and report may still run
    assert shared.position() == {"policy_dir": "/p/v1", "policy_version": 1, "mlflow_run_id": "m"}
    assert (state.policy_dir, state.policy_version) == ("/p/v0", 0)  # recorded only once reported


def test_publish_waits_while_an_evaluation_runs() -> None:
    import threading
    import time

    shared = ov.Overlap(cfg=_cfg(), state=RunState(run_id="r", config={}, policy_dir="/p"))
    assert shared.wait_evaluated() < 0.1  # nothing evaluating: no wait
    shared.evaluating()
    threading.Timer(0.6, shared.evaluated).start()
    t0 = time.monotonic()
    waited = shared.wait_evaluated(poll_s=0.05)
    assert 0.5 < waited < 5 and time.monotonic() - t0 >= 0.5
    shared.evaluating()
    threading.Timer(0.2, lambda: setattr(shared, "stop", "producer failed: boom")).start()
    with pytest.raises(ClawpipeError, match="producer failed: boom"):  # a failed side never leaves it waiting
        shared.wait_evaluated(poll_s=0.05)


def test_publish_waits_until_every_running_evaluation_ended() -> None:
    import threading

    # a skipped step (nothing to publish) starts its evaluation while the previous step's still runs
    shared = ov.Overlap(cfg=_cfg(), state=RunState(run_id="r", config={}, policy_dir="/p"))
    shared.evaluating()
    shared.evaluating()
    shared.evaluated()  # the first evaluation ends; the second still rolls out on the live policy
    done = threading.Event()
    threading.Thread(target=lambda: (shared.wait_evaluated(poll_s=0.05), done.set()), daemon=True).start()
    assert not done.wait(0.4)  # the publish still waits
    shared.evaluated()
    assert done.wait(5)


def test_publish_after_a_failed_evaluation_raises_instead_of_publishing() -> None:
    shared = ov.Overlap(cfg=_cfg(), state=RunState(run_id="r", config={}, policy_dir="/p"))
    shared.evaluating()
    shared.stop = "step 3 failed: evaluation rollouts failed"
    shared.evaluated()  # the evaluation ended, in failure, before the next step reached its publish
    with pytest.raises(ClawpipeError, match="step 3 failed"):
        shared.wait_evaluated(poll_s=0.05)


def test_spans_are_kept_per_iteration() -> None:
    import time

    shared = ov.Overlap(cfg=_cfg(), state=RunState(run_id="r", config={}, policy_dir="/p"))
    shared.span("producer", "rollout", 0, shared.t0)
    shared.span("producer", "rollout", 1, shared.t0)
    time.sleep(0.05)
    started = time.monotonic()
    time.sleep(0.05)
    shared.span("trainer", "train", 0, started)
    spans = shared.spans_of(0)
    assert set(spans) == {"rollout", "train"}
    assert spans["rollout"][0] == 0 and 0.04 <= spans["train"][0] < spans["train"][1]


def test_a_stopped_side_stops_the_other() -> None:
    shared = ov.Overlap(cfg=_cfg(), state=RunState(run_id="r", config={}, policy_dir="/p"))
    shared.check()
    shared.stop = "trainer failed: boom"
    with pytest.raises(ClawpipeError, match="trainer failed: boom"):
        shared.check()


def test_staleness_counts_ages_and_drops_the_excess() -> None:
    record = ov.staleness({0: 5, 1: 3, 3: 2}, max_staleness=1)
    assert record["ages"] == {"0": 5, "1": 3, "2": 0, "3": 2}  # no holes in the histogram
    assert (record["trained_calls"], record["dropped_calls"], record["max_age"]) == (8, 2, 1)
    assert record["mean_age"] == pytest.approx(3 / 8)
    assert ov.staleness({2: 4}, max_staleness=0)["trained_calls"] == 0
    assert ov.staleness({}, max_staleness=1)["ages"] == {"0": 0}


def test_overlap_record_becomes_mlflow_metrics() -> None:
    summary = {
        "iteration": 2,
        "reward_mean": 0.1,
        "by_harness": {},
        "seconds": 3.0,
        "eval_by_harness": None,
        "overlap": {
            **ov.staleness({0: 5, 1: 3}, 1),
            "trainer_wait_s": 1.5,
            "producer_wait_s": None,
            "publish_wait_s": 0.25,
            "skipped": False,
        },
    }
    metrics = iteration_metrics(summary)
    assert metrics["staleness/age_0"] == 5 and metrics["staleness/age_1"] == 3
    assert metrics["staleness/dropped_calls"] == 0 and metrics["wait/trainer_s"] == 1.5
    assert "wait/producer_s" not in metrics and metrics["staleness/skipped_step"] == 0
    assert metrics["wait/publish_s"] == 0.25  # the publish that waited for the previous step's evaluation
    assert not any(k.startswith(("staleness/", "wait/")) for k in iteration_metrics({**summary, "overlap": None}))


def test_take_batch_waits_for_landing_and_rejects_short_groups(tmp_path: Path, monkeypatch) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from clawpipe.config import Settings
    from clawpipe.schemas import ROLLOUTS
    from clawpipe.tables import partition_dir

    monkeypatch.setenv("CLAWPIPE_HOME", str(tmp_path))
    settings = Settings()
    cfg = _cfg(harnesses=[{"name": "chat-loop", "task_set": "guess"}])
    shared = ov.Overlap(cfg=cfg, state=RunState(run_id="r", config={}, policy_dir="/p"))
    assert ov.take_batch(shared, settings, "r", 0) is None  # not landed by the producer yet

    def write(rows: list[tuple[str, str]]) -> None:
        d = partition_dir(settings.lake_dir, "rollouts", "r", 0)
        d.mkdir(parents=True, exist_ok=True)
        cols = {f.name: [None] * len(rows) for f in ROLLOUTS}
        cols.update(
            rollout_id=[r for r, _ in rows],
            group_id=[g for _, g in rows],
            run_id=["r"] * len(rows),
            iteration=[0] * len(rows),
            status=["succeeded"] * len(rows),
            reward=[0.5] * len(rows),
            harness=["chat-loop"] * len(rows),
        )
        pq.write_table(pa.table(cols, schema=ROLLOUTS), d / "part-0.parquet")

    write([("g1.0", "g1"), ("g1.1", "g1"), ("g2.0", "g2")])
    shared.landed.add(0)
    with pytest.raises(ClawpipeError, match="fewer than 2 complete groups of 2"):
        ov.take_batch(shared, settings, "r", 0)
    write([("g1.0", "g1"), ("g1.1", "g1"), ("g2.0", "g2"), ("g2.1", "g2")])
    rows = ov.take_batch(shared, settings, "r", 0)
    assert rows is not None and sorted(r["rollout_id"] for r in rows) == ["g1.0", "g1.1", "g2.0", "g2.1"]


def test_call_ages_count_only_calls_of_rollouts_with_a_result(tmp_path: Path, monkeypatch) -> None:
    import pyarrow as pa

    from clawpipe import tables
    from clawpipe.config import Settings
    from clawpipe.schemas import MODEL_CALLS, ROLLOUTS

    monkeypatch.setenv("CLAWPIPE_HOME", str(tmp_path))
    settings = Settings()
    rollouts = [("g1.0", False), ("g1.1", False), ("eval.greedy.t1", True)]
    tables.replace_partition(
        settings.lake_dir, "rollouts", "r", 0,
        pa.Table.from_pylist(
            [dict(rollout_id=rid, run_id="r", iteration=0, status="succeeded", reward=1.0, eval=ev)
             for rid, ev in rollouts],
            schema=ROLLOUTS,
        ),
    )  # fmt: skip
    # (rollout, policy_version, calls): "g1.2" was cut off by a kill and has no result row
    calls = [("g1.0", 0, 2), ("g1.1", 1, 3), ("eval.greedy.t1", 1, 1), ("g1.2", 0, 4)]
    rows = [
        dict(call_id=f"{rid}-{k}", choice_index=0, run_id="r", iteration=0, rollout_id=rid, status="ok",
             policy_version=v, prompt_token_ids=[1, 2], completion_token_ids=[3])
        for rid, v, n in calls for k in range(n)
    ]  # fmt: skip
    rows.append(dict(rows[0], call_id="empty", completion_token_ids=[]))  # nothing sampled: not trainable
    tables.replace_partition(settings.lake_dir, "model_calls", "r", 0, pa.Table.from_pylist(rows, schema=MODEL_CALLS))
    assert ov.call_ages(settings, "r", 0, policy_version=1) == {1: 2, 0: 3}


@pytest.mark.slow
def test_the_run_training_process_imports_torch_before_its_first_step(tmp_path: Path, monkeypatch) -> None:
    """The trainer starts the run's training process when it starts (stages.start_trainer): the process has
    loaded torch while the first batch still rolls out, before any step was asked of it."""
    import time

    from clawpipe.config import Settings
    from clawpipe.pipeline import stages
    from clawpipe.pipeline.train_worker import close_worker, worker_for

    monkeypatch.setenv("CLAWPIPE_HOME", str(tmp_path))
    settings = Settings()
    stages.start_trainer(_cfg(), settings, "warm")
    proc = worker_for("warm", settings.runs_dir / "warm" / "logs" / "trainer.log")._proc
    try:
        assert proc is not None and proc.poll() is None
        maps = Path(f"/proc/{proc.pid}/maps")
        deadline = time.monotonic() + 240
        while "libtorch" not in maps.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert "libtorch" in maps.read_text(), (settings.runs_dir / "warm" / "logs" / "trainer.log").read_text()
    finally:
        close_worker("warm")
    assert proc.wait(timeout=30) == 0  # stdin closed without a request: it exits cleanly
