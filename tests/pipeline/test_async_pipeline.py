"""The async loop end to end: a rollout producer and a trainer overlapping on real sandboxes (process backend),
the capture proxy, the engine, the lake, the trees and the trainer, with MLflow and Prefect.

Run A (max_staleness 1, a held-out evaluation after every step): batches overlap training (batch 1 starts
before the first publish), every rollout and call lands once, no trained call is more than one version old,
the staleness histogram and waits reach MLflow, and each evaluation runs beside the next step without
keeping the trainer from taking its batch, while every evaluation call is served by the policy it
evaluates. Run B (max_staleness 0, killed after its first step, then resumed): the calls sampled before
the last publish are dropped, counted by the step and by the trainer exactly as the lake counts them, and
the resumed run loses and duplicates nothing.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from clawpipe import tables

pytestmark = [pytest.mark.slow]

CONFIG = """
run_name = "{name}"
experiment = "async"
mode = "async"
max_staleness = {staleness}
iterations = 3
groups = 2
samples = 2
concurrency = 4
backend = "process"
{evaluation}
train = {{ learning_rate = 0.002, epochs = 1 }}
[[harnesses]]
name = "chat-loop"
task_set = "guess"
"""
EVAL_EVERY_STEP = "eval_tasks = 2\neval_samples = 1\neval_every = 1"
# how long after its batch landed (or the step before returned) the trainer may take it: two polls and a lake
# query; an evaluation (a subflow and four sandboxed rollouts) takes longer, so a trainer waiting for it fails
TAKE_SLACK_S = 1.5


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("async") / "home"


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "CLAWPIPE_"))}
    env.update({"CLAWPIPE_HOME": str(home), "PYTHONUNBUFFERED": "1"})
    return env


def _query(home: Path, run_id: str):
    con = tables.connect(home / "lake")
    return lambda sql: con.sql(sql, params={"r": run_id}).fetchall()


def _assert_exactly_once(q: Any) -> None:
    assert q(
        "select iteration, count(*), count(distinct group_id) from rollouts where run_id=$r and not eval "
        "group by 1 order by 1"
    ) == [(0, 4, 2), (1, 4, 2), (2, 4, 2)]
    assert q("select count(*) - count(distinct rollout_id) from rollouts where run_id=$r") == [(0,)]
    assert q("select count(*) - count(distinct (call_id, choice_index)) from model_calls where run_id=$r") == [(0,)]


def _stale_in_lake(q: Any, iteration: int, oldest: int) -> int:
    """Trainable calls of the iteration sampled by a policy_version below ``oldest`` (calls of a rollout cut
    off by the kill have no result row and are never trained)."""
    return q(
        f"select count(*) from model_calls c where run_id=$r and iteration={iteration} and status='ok' "
        f"and len(completion_token_ids) > 0 and policy_version < {oldest} and exists (select 1 from rollouts r "
        "where r.run_id=$r and r.rollout_id=c.rollout_id and not r.eval)"
    )[0][0]


def test_async_run_overlaps_and_bounds_staleness(home: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "a.toml"
    cfg.write_text(CONFIG.format(name="a", staleness=1, evaluation=EVAL_EVERY_STEP))
    out = tmp_path / "a.json"
    proc = subprocess.run(
        [sys.executable, "-m", "clawpipe", "run", "--config", str(cfg), "--summary-out", str(out)],
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads(out.read_text())
    run_id = summary["run_id"]
    q = _query(home, run_id)
    _assert_exactly_once(q)
    steps = [s["overlap"] for s in summary["iterations"]]
    assert [s["policy_version"] for s in summary["iterations"]] == [1, 2, 3]
    # overlap: batch 1 was rolled out while step 0 trained, so its rollouts started at policy_version 0
    assert q("select distinct policy_version from rollouts where run_id=$r and iteration=1 and not eval") == [(0,)]
    for it, step in enumerate(steps):
        assert step["max_age"] <= 1 and step["dropped_calls"] == 0
        assert step["trained_calls"] == sum(step["ages"].values()) > 0
        assert step["trained_calls"] == _stale_in_lake(q, it, 10**9)
    # evaluation: every call of step k's held-out rollouts was served by the policy step k published (the next
    # publish waited for them), and the next step's training did not wait for it
    assert q(
        "select r.iteration, min(c.policy_version), max(c.policy_version), count(distinct r.rollout_id) "
        "from model_calls c join rollouts r using (rollout_id) where c.run_id=$r and r.eval group by 1 order by 1"
    ) == [(0, 1, 1, 4), (1, 2, 2, 4), (2, 3, 3, 4)]
    spans = [step["spans"] for step in steps]
    for before, after in itertools.pairwise(spans):
        assert after["publish"][0] >= before["evaluate"][1], spans
        # the trainer takes batch k+1 as soon as it has landed and step k returned (a poll or two), whether or
        # not step k's evaluation still runs, and nothing but the publish waits inside the step
        assert after["take"][1] <= max(after["take"][0], after["land"][1]) + TAKE_SLACK_S, spans
        assert after["train"][0] - after["trees"][1] <= 0.05, spans
    assert [s["eval_sampled_reward_mean"] is not None for s in summary["iterations"]] == [True] * 3
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{home.resolve() / 'mlflow.db'}")
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.params["mode"] == "async"
    age0 = client.get_metric_history(run.info.run_id, "staleness/age_0")
    assert sorted(m.step for m in age0) == [0, 1, 2]
    assert {m.step for m in client.get_metric_history(run.info.run_id, "staleness/dropped_calls")} == {0, 1, 2}
    assert {m.step for m in client.get_metric_history(run.info.run_id, "wait/trainer_s")} == {0, 1, 2}


def test_async_drops_stale_calls_and_resumes_exactly_once(home: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "b.toml"
    cfg.write_text(CONFIG.format(name="b", staleness=0, evaluation="eval_tasks = 0"))
    with open(tmp_path / "b.log", "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "clawpipe", "run", "--config", str(cfg)],
            env=_env(home),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    state_path = None
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None and state_path is None:
        for p in (home / "runs").glob("b-*/state.json"):
            if len(json.loads(p.read_text())["completed"]) >= 1:
                state_path = p
        time.sleep(0.5)
    assert state_path is not None, (tmp_path / "b.log").read_text()[-4000:]
    os.killpg(proc.pid, signal.SIGKILL)  # flow, engine, proxy and sandboxes, mid-way through later batches
    proc.wait()
    run_id = state_path.parent.name
    resumed = subprocess.run(
        [sys.executable, "-m", "clawpipe", "run", "--resume", run_id],
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    state = json.loads(state_path.read_text())
    assert [s["iteration"] for s in state["completed"]] == [0, 1, 2]
    q = _query(home, run_id)
    _assert_exactly_once(q)
    dropped_total = 0
    for it, s in enumerate(state["completed"]):
        step = s["overlap"]
        assert step["max_age"] == 0  # max_staleness 0: only calls of the policy being trained
        assert step["dropped_calls"] == _stale_in_lake(q, it, step["trained_from"])
        assert step["trained_calls"] + step["dropped_calls"] == _stale_in_lake(q, it, 10**9)
        dropped_total += step["dropped_calls"]
    # batches 1 and 2 start before the publish that their step trains from, so some calls are always too old
    assert dropped_total > 0
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{home.resolve() / 'mlflow.db'}")
    history = client.get_metric_history(state["mlflow_run_id"], "train/load/calls_stale_dropped")
    by_step = {m.step: m.value for m in history}
    for it, s in enumerate(state["completed"]):
        if not s["overlap"]["skipped"]:
            assert by_step[it] == s["overlap"]["dropped_calls"]
