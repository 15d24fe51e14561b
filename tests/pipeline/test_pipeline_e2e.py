"""The pipeline end to end through Prefect: real sandboxes, proxy, engine, lake, trees, trainer, MLflow.

Run A: two harnesses in bwrap, two iterations; the lake then holds calls, rollouts and trees for each
iteration, MLflow holds the run, and calls of iteration 1 were served by the published checkpoint.
Run B: injected failures in rollout/land/reconstruct (each retried by Prefect), then a kill -9 after the
first iteration and `clawpipe run --resume`: every rollout and call is in the lake exactly once.
Both runs sit in one MLflow experiment, comparable side by side.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clawpipe import tables

pytestmark = [pytest.mark.slow]

BASE = """
experiment = "e2e"
groups = 2
samples = 2
concurrency = 4
train = {{ learning_rate = 0.002, epochs = 1 }}
{extra}
[[harnesses]]
name = "chat-loop"
task_set = "guess"
[[harnesses]]
name = "compacting-agent"
task_set = "guess"
"""


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pipeline") / "home"


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update({"CLAWPIPE_HOME": str(home), "PYTHONUNBUFFERED": "1", **extra})
    return env


def _run(args: list[str], home: Path, timeout: float = 900, **extra: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-m", "clawpipe", *args],
        env=_env(home, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


def _lake(home: Path):
    return tables.connect(home / "lake")


@pytest.mark.sandbox
def test_two_harness_pipeline_in_bwrap(home: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "a.toml"
    cfg.write_text(BASE.format(extra='run_name = "a"\niterations = 2\nbackend = "bwrap"\neval_tasks = 1'))
    summary_path = tmp_path / "a.json"
    _run(["run", "--config", str(cfg), "--summary-out", str(summary_path)], home)
    summary = json.loads(summary_path.read_text())
    run_id = summary["run_id"]
    assert [s["iteration"] for s in summary["iterations"]] == [0, 1]
    assert summary["peak_memory_mb"] > 0
    con = _lake(home)
    q = lambda sql: con.sql(sql, params={"r": run_id}).fetchall()  # noqa: E731
    per_it = q("select iteration, count(*) from rollouts where run_id=$r and not eval group by 1 order by 1")
    assert per_it == [(0, 8), (1, 8)]
    assert q("select count(distinct harness) from rollouts where run_id=$r") == [(2,)]
    assert q("select distinct iteration from model_calls where run_id=$r order by 1") == [(0,), (1,)]
    assert q("select distinct iteration from tree_nodes where run_id=$r order by 1") == [(0,), (1,)]
    # calls of iteration 1 were answered by the checkpoint published after iteration 0
    assert q(
        "select distinct policy_version from model_calls where run_id=$r and iteration=1 and not "
        "rollout_id like 'eval.%'"
    ) == [(1,)]
    assert q("select count(*) from model_calls where run_id=$r and token_source='upstream'")[0][0] > 0
    assert (home / "runs" / run_id / "checkpoints").is_dir()
    for it in (0, 1):  # each iteration's summary renders its most branched rollout tree
        (page,) = (home / "runs" / run_id / "trees").glob(f"it{it}-rollout-*.html")
        assert "<html" in page.read_text().lower()
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{home.resolve() / 'mlflow.db'}")
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.params["iterations"] == "2"
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert sorted(m.step for m in history) == [0, 1]


def test_retries_and_resume_leave_exactly_once_data(home: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "b.toml"
    cfg.write_text(BASE.format(extra='run_name = "b"\niterations = 2\nbackend = "process"\neval_tasks = 0'))
    env = _env(home, CLAWPIPE_INJECT_FAULTS="rollout_batch@0,land_batch@0,reconstruct_batch@0")
    log_path = tmp_path / "b.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "clawpipe", "run", "--config", str(cfg)],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    runs = home / "runs"
    state_path = None
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        for p in runs.glob("b-*/state.json") if runs.is_dir() else []:
            if len(json.loads(p.read_text())["completed"]) >= 1:
                state_path = p
        if state_path:
            break
        time.sleep(0.5)
    assert state_path is not None, log_path.read_text()[-4000:]
    os.killpg(proc.pid, signal.SIGKILL)  # the whole run: flow, engine, proxy, sandboxes
    proc.wait()
    run_id = state_path.parent.name
    log = (_run(["run", "--resume", run_id], home)).stdout
    state = json.loads(state_path.read_text())
    assert [s["iteration"] for s in state["completed"]] == [0, 1], log[-3000:]
    assert state["policy_version"] == 2
    faults = sorted(p.name for p in (runs / "faults").iterdir())
    assert faults == ["land_batch@0", "reconstruct_batch@0", "rollout_batch@0"]
    con = _lake(home)
    q = lambda sql: con.sql(sql, params={"r": run_id}).fetchall()  # noqa: E731
    assert q(
        "select iteration, count(*), count(distinct group_id) from rollouts where run_id=$r group by 1 order by 1"
    ) == [(0, 8, 4), (1, 8, 4)]
    assert q("select count(*) - count(distinct (call_id, choice_index)) from model_calls where run_id=$r") == [(0,)]
    assert q("select count(*) - count(distinct rollout_id) from rollouts where run_id=$r") == [(0,)]
    # every rollout that has a result row has its calls; a rollout cut off by the injected fault was rerun
    # under a new id in the same group, so no result row is shared by two attempts' calls
    assert q(
        "select count(*) from rollouts r where run_id=$r and status='succeeded' and not exists "
        "(select 1 from model_calls c where c.rollout_id=r.rollout_id and c.run_id=$r)"
    ) == [(0,)]


def test_runs_are_comparable_in_one_mlflow_experiment(home: Path) -> None:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{home.resolve() / 'mlflow.db'}")
    exp = client.get_experiment_by_name("e2e")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time"])
    names = [r.data.params.get("run_name") for r in runs]
    assert {"a", "b"} <= set(names)
    a = next(r for r in runs if r.data.params.get("run_name") == "a")
    b = next(r for r in runs if r.data.params.get("run_name") == "b")
    assert a.data.params["backend"] != b.data.params["backend"]
    assert "reward/mean" in a.data.metrics and "reward/mean" in b.data.metrics
