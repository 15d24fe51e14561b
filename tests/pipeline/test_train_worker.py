"""The run's long-lived training process: steps on a real lake and tiny policy, one process for many steps,
the same update as an in-process train_step, a failed step that leaves the process up, a dead process
replaced on the next step."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from clawpipe.configfile import write_config
from clawpipe.errors import TrainingError
from clawpipe.pipeline.train_worker import TrainWorker
from clawpipe.serving.policy import init_policy
from clawpipe.train.checkpoint import load_policy
from clawpipe.train.config import make_config
from clawpipe.train.step import train_step
from tests.train.test_step import RUN, write_lake

pytestmark = [pytest.mark.slow]


def _request(tmp_path: Path, policy: Path, iteration: int, out: Path) -> dict:
    config = write_config(make_config(), tmp_path / f"config-{iteration}.json")
    return {
        "run_id": RUN,
        "iteration": iteration,
        "config": str(config),
        "policy": str(policy),
        "out": str(out),
        "metrics_out": str(tmp_path / f"metrics-{iteration}.json"),
        "mlflow_run_id": None,
    }


def test_worker_steps_match_train_step_and_survive_failures(home: Path, tmp_path: Path) -> None:
    policy = init_policy(tmp_path / "v0", size="tiny", seed=0)
    lake = home / "lake"
    for it in (0, 1):
        write_lake(lake, policy, iteration=it)
    worker = TrainWorker(tmp_path / "trainer.log")
    try:
        worker.step(_request(tmp_path, policy, 0, tmp_path / "w"))
        pid = worker._proc.pid if worker._proc else None
        first = json.loads((tmp_path / "metrics-0.json").read_text())
        assert first["policy_version"] == 1
        worker.step(_request(tmp_path, Path(first["checkpoint"]), 1, tmp_path / "w"))
        assert worker._proc is not None and worker._proc.pid == pid  # one process, imports paid once
        assert json.loads((tmp_path / "metrics-1.json").read_text())["policy_version"] == 2

        # the same step in this process gives the same update
        direct = train_step(RUN, 0, lake_root=lake, policy_dir=policy, out_dir=tmp_path / "d", config=make_config())
        assert direct.metrics["loss/total"] == pytest.approx(first["metrics"]["loss/total"], abs=1e-6)
        a = load_policy(first["checkpoint"]).model.state_dict()
        b = load_policy(direct.checkpoint_dir).model.state_dict()
        assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)

        # a failing step is reported with its reason; the process stays up for the retry
        with pytest.raises(TrainingError, match="training step failed"):
            worker.step(_request(tmp_path, tmp_path / "no-such-policy", 0, tmp_path / "w"))
        assert worker._proc.pid == pid and worker._proc.poll() is None

        # a dead process is replaced on the next step
        os.kill(pid, signal.SIGKILL)
        worker._proc.wait()
        worker.step(_request(tmp_path, policy, 0, tmp_path / "w2"))
        assert worker._proc.pid != pid
    finally:
        worker.close()
    assert worker._proc is None
