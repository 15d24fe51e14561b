"""A training process that lives as long as the run: one ``clawpipe train`` step per request, imports paid once.

Starting a fresh ``clawpipe train`` process per iteration cost more than the step itself on the 2-core
machine (importing torch, transformers and MLflow took 10-50 s depending on load; the tiny policy's step
takes 0.4-2 s). The pipeline therefore keeps one child process per run that reads one JSON request per
line on stdin ({run_id, iteration, config, policy, out, metrics_out, mlflow_run_id}), takes the step the
same way the CLI does (clawpipe.train.step.train_step, metrics into the run's MLflow run), writes the
metrics file and answers one JSON line on stdout. The child is still its own process: a crash in it fails
the step (the task's retry starts a new child), never the flow. Run as ``python -m
clawpipe.pipeline.train_worker``.

A config with ``nproc > 1`` (distributed training) is the exception: this process then starts
torch.distributed's launcher for the step (``clawpipe train`` as nproc ranks, clawpipe.train.launch) and
waits for it, so each distributed step has ranks and a process group of its own. Ranks are not kept
across steps on purpose: after a failed collective (a rank killed, an NCCL timeout) the communicator is
unusable and the surviving ranks are in no known state, while a launch per step is torn down whole by the
launcher; the import time it pays per step is small next to a step that needs several devices.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import IO, Any

from clawpipe.errors import TrainingError

log = logging.getLogger(__name__)


def take_step(request: dict[str, Any]) -> dict[str, Any]:
    """One training step as ``clawpipe train --config --policy --out --metrics-out [--mlflow-run-id]`` does it."""
    from clawpipe.config import prepare_environment
    from clawpipe.tracking import make_tracker
    from clawpipe.train.config import load_config
    from clawpipe.train.step import train_step

    settings = prepare_environment()
    cfg = load_config(Path(request["config"]))
    if getattr(cfg, "nproc", 1) * getattr(cfg, "nnodes", 1) > 1:  # several ranks: the elastic launcher
        return _take_distributed_step(request, cfg)
    mlflow_run_id = request.get("mlflow_run_id")
    tracker = make_tracker(bool(mlflow_run_id))
    if mlflow_run_id:
        tracker.start_run(mlflow_run_id=mlflow_run_id)
        tracker.log_params({f"train.{k}": v for k, v in cfg.flat_params().items()})
    result = train_step(
        request["run_id"],
        int(request["iteration"]),
        lake_root=settings.lake_dir,
        policy_dir=Path(request["policy"]),
        out_dir=Path(request["out"]),
        config=cfg,
        tracker=tracker,
    )
    done = {
        "checkpoint": str(result.checkpoint_dir),
        "policy_version": result.policy_version,
        "metrics": result.metrics,
    }
    Path(request["metrics_out"]).write_text(json.dumps(done, default=float))
    return done


def _take_distributed_step(request: dict[str, Any], cfg: Any) -> dict[str, Any]:
    """The step as nproc ranks under torch.distributed.run; their output goes to stderr (stdout is replies)."""
    from clawpipe.train.launch import launcher_command, run_distributed, step_arguments

    metrics_out = Path(request["metrics_out"])
    args = step_arguments(
        request["run_id"],
        int(request["iteration"]),
        config=Path(request["config"]),
        policy=Path(request["policy"]),
        out=Path(request["out"]),
        metrics_out=metrics_out,
        mlflow_run_id=request.get("mlflow_run_id"),
        track=bool(request.get("mlflow_run_id")),
    )
    rdzv_id = f"{request['run_id']}-{request['iteration']}"
    command = launcher_command(cfg.nproc, nnodes=cfg.nnodes, rdzv_endpoint=cfg.rdzv_endpoint, rdzv_id=rdzv_id)
    return run_distributed(command + args, metrics_out, output=sys.stderr.fileno())


def serve(requests: IO[str], replies: IO[str]) -> None:
    """Answer each request line with {"ok": true} or {"ok": false, "error": ...} until stdin closes."""
    for line in requests:
        if not line.strip():
            continue
        try:
            with contextlib.redirect_stdout(sys.stderr):  # stdout carries the replies only
                take_step(json.loads(line))
            reply: dict[str, Any] = {"ok": True}
        except Exception as exc:  # the step fails, the worker stays up for the retry
            traceback.print_exc(file=sys.stderr)
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


class TrainWorker:
    """The flow side: starts the child on first use, sends one step at a time, restarts a dead child."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the child now (it imports the trainer before reading its first request)."""
        with self._lock:
            self._start()

    def step(self, request: dict[str, Any]) -> None:
        with self._lock:
            proc = self._start()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps(request) + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
            except OSError:
                line = ""
            if not line:
                self.close()
                raise TrainingError(f"the training process exited (code {proc.poll()}): {self._tail()}")
            reply = json.loads(line)
            if not reply.get("ok"):
                raise TrainingError(f"training step failed: {reply.get('error')}\n{self._tail()}")

    def _start(self) -> subprocess.Popen[str]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        from clawpipe.pipeline.services import _die_with_parent

        with open(self.log_path, "ab") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "clawpipe.pipeline.train_worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                preexec_fn=_die_with_parent,
            )
        return self._proc

    def _tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin:
                proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_WORKERS: dict[str, TrainWorker] = {}
_WORKERS_LOCK = threading.Lock()


def worker_for(run_id: str, log_path: Path) -> TrainWorker:
    """The run's training process in this (the flow's) process, started on its first step."""
    with _WORKERS_LOCK:
        if run_id not in _WORKERS:
            _WORKERS[run_id] = TrainWorker(log_path)
        return _WORKERS[run_id]


def close_worker(run_id: str) -> None:
    with _WORKERS_LOCK:
        worker = _WORKERS.pop(run_id, None)
    if worker is not None:
        worker.close()


def _import_trainer() -> None:
    """Pay the imports of a step (torch, transformers, MLflow) before the first request arrives: a child
    started ahead of its first step (TrainWorker.start) imports while the flow still rolls out."""
    with contextlib.redirect_stdout(sys.stderr):
        from clawpipe.config import prepare_environment

        prepare_environment()
        for module in ("clawpipe.tracking", "clawpipe.train.step"):
            importlib.import_module(module)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _import_trainer()
    serve(sys.stdin, sys.stdout)
