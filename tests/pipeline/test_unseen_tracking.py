"""Runs started together on a fresh home share one MLflow sqlite store: the first client of each process
would create its tables at once with the others (one failing with ``duplicate column name``), and each would
create the experiment; they do so one at a time, so every run gets its MLflow run, in one experiment whose
artifacts go under the home."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STARTER = """
import sys, time
from pathlib import Path
import mlflow  # imported before the start line, as a flow process has it
from clawpipe.tracking import make_tracker
folder = Path(sys.argv[1])
(folder / f"ready-{sys.argv[2]}").touch()
while not (folder / "go").exists():
    time.sleep(0.01)
tracker = make_tracker(experiment="together")
print(tracker.start_run(f"run-{sys.argv[2]}"))
"""
PROCESSES = 3


@pytest.mark.slow
@pytest.mark.parametrize("trial", [1, 2])
def test_runs_started_together_on_a_fresh_store_each_get_their_mlflow_run(tmp_path: Path, trial: int) -> None:
    # before: 6 of 9 such processes (3 trials of 3) failed creating the store's tables
    home = tmp_path / "home"
    uri = f"sqlite:///{home / 'mlflow.db'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "CLAWPIPE_"))}
    env.update({"CLAWPIPE_HOME": str(home), "CLAWPIPE_MLFLOW_TRACKING_URI": uri})
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", STARTER, str(tmp_path), str(i)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(PROCESSES)
    ]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready-*"))) < PROCESSES and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.05)
    (tmp_path / "go").touch()  # all of them create their client now
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * PROCESSES, [err[-2000:] for _, err in outs]

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("together")
    assert experiment is not None
    # beside the database, not in an mlruns folder of the directory the processes ran in (ROOT here)
    assert experiment.artifact_location == (home / "mlartifacts").resolve().as_uri()
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == [f"run-{i}" for i in range(PROCESSES)]
    assert sorted(r.info.run_id for r in runs) == sorted(out.strip() for out, _ in outs)
