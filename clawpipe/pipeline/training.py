"""The training stage of an iteration: one step outside the flow's process, with the run's trainer config.

The step goes to the run's long-lived training process (clawpipe/pipeline/train_worker.py), or runs as a
``clawpipe train`` process of its own when it needs several (distributed training) or
CLAWPIPE_TRAIN_PROCESS=step asks for it. clawpipe/pipeline/stages.py re-exports these functions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from clawpipe.config import Settings
from clawpipe.errors import TrainingError
from clawpipe.pipeline.config import PipelineConfig


def train(
    cfg: PipelineConfig,
    settings: Settings,
    run_id: str,
    iteration: int,
    *,
    policy_dir: Path,
    out_dir: Path,
    mlflow_run_id: str | None = None,
) -> dict[str, Any]:
    """One training step outside the flow's process; returns {checkpoint, policy_version, metrics}.

    The step runs in the run's long-lived training process (clawpipe.pipeline.train_worker), which pays
    the torch imports once per run, or as a ``clawpipe train`` process of its own (see _persistent_trainer).

    With ``mlflow_run_id`` the trainer logs its config and per-step metrics into that (the pipeline's) run.
    Harnesses whose manifest sets ``[training] exclude_side_calls = true`` train only on their main lineage
    (``exclude_side_calls_harnesses``), unless ``train.exclude_side_calls_harnesses`` is set in the config.
    """
    from clawpipe.configfile import write_config

    train_values = dict(cfg.train)
    config_path = write_config(make_train_config(cfg), out_dir / f"train-config-{iteration}.json")
    metrics_path = out_dir / f"metrics-{iteration}.json"
    cmd = [
        sys.executable,
        "-m",
        "clawpipe",
        "train",
        "--run",
        run_id,
        "--iteration",
        str(iteration),
        "--config",
        str(config_path),
        "--policy",
        str(policy_dir),
        "--out",
        str(out_dir),
        "--metrics-out",
        str(metrics_path),
        *(["--mlflow-run-id", mlflow_run_id] if mlflow_run_id else ["--no-track"]),
    ]
    if _persistent_trainer(train_values):
        from clawpipe.pipeline.train_worker import worker_for

        request = {
            "run_id": run_id,
            "iteration": iteration,
            "config": str(config_path),
            "policy": str(policy_dir),
            "out": str(out_dir),
            "metrics_out": str(metrics_path),
            "mlflow_run_id": mlflow_run_id,
        }
        worker_for(run_id, settings.runs_dir / run_id / "logs" / "trainer.log").step(request)
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise TrainingError(f"training step failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return dict(json.loads(metrics_path.read_text()))


def make_train_config(cfg: PipelineConfig) -> Any:
    """The run's trainer config: its ``train`` table over the trainer's defaults, plus the harnesses whose
    manifest sets ``[training] exclude_side_calls = true`` unless the table names them itself."""
    from clawpipe.sandbox.manifest import find_harness
    from clawpipe.train.config import make_config

    train_values = dict(cfg.train)
    if "exclude_side_calls_harnesses" not in train_values:
        names = dict.fromkeys(h.name for h in cfg.harnesses)
        train_values["exclude_side_calls_harnesses"] = [n for n in names if find_harness(n).exclude_side_calls]
    return make_config(**train_values)


def start_trainer(cfg: PipelineConfig, settings: Settings, run_id: str) -> None:
    """Start the run's training process ahead of its first step (it imports torch meanwhile); nothing when
    steps are launched on their own (see _persistent_trainer)."""
    if _persistent_trainer(dict(cfg.train)):
        from clawpipe.pipeline.train_worker import worker_for

        worker_for(run_id, settings.runs_dir / run_id / "logs" / "trainer.log").start()


def _persistent_trainer(train_values: dict[str, Any]) -> bool:
    """Steps go to the run's long-lived training process (clawpipe.pipeline.train_worker) unless the step
    must be launched on its own (several processes) or CLAWPIPE_TRAIN_PROCESS=step asks for the CLI."""
    ranks = int(train_values.get("nproc") or 1) * int(train_values.get("nnodes") or 1)
    return ranks == 1 and os.environ.get("CLAWPIPE_TRAIN_PROCESS") != "step"
