"""Run state on disk, so a killed run resumes from its last completed iteration.

``<home>/runs/<run_id>/state.json`` holds the config, the current policy (directory and version), the
MLflow run id, what the run used (its provenance) and one summary per completed iteration. It is rewritten
atomically after each iteration, after that iteration's lake partitions and checkpoint exist, so it never
points at missing data.
``<home>/runs/<run_id>/run.lock`` is held (``flock``) by the process running the run, so the same run is
never driven by two processes at once; the kernel drops it when that process dies, even by SIGKILL.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clawpipe.errors import ConfigError


@dataclass
class RunState:
    run_id: str
    config: dict[str, Any]
    policy_dir: str
    policy_version: int = 0
    mlflow_run_id: str | None = None
    completed: list[dict[str, Any]] = field(default_factory=list)  # one summary per finished iteration
    peak_memory_mb: float = 0.0
    flow_run_id: str | None = None  # the Prefect flow run that started it: a retry of that flow run resumes it
    # what the run used beyond its config (harness, task set and policy hashes, git, versions), recorded once
    # at its start (clawpipe/pipeline/provenance.py); kept here too, for a run whose MLflow store was away
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def next_iteration(self) -> int:
        return len(self.completed)

    def position(self) -> dict[str, Any]:
        """Where the next iteration starts: the policy (directory and version) and the MLflow run."""
        return {
            "policy_dir": self.policy_dir,
            "policy_version": self.policy_version,
            "mlflow_run_id": self.mlflow_run_id,
        }

    def complete(self, summary: dict[str, Any], *, peak_memory_mb: float) -> None:
        """Record a finished iteration: its summary, and the policy it published."""
        self.completed.append(summary)
        self.policy_dir, self.policy_version = summary["policy_dir"], summary["policy_version"]
        self.peak_memory_mb = max(self.peak_memory_mb, peak_memory_mb)

    def save(self, runs_dir: Path) -> Path:
        path = runs_dir / self.run_id / "state.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2, default=str))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, runs_dir: Path, run_id: str) -> RunState:
        path = runs_dir / run_id / "state.json"
        if not path.is_file():
            known = (
                sorted(p.name for p in runs_dir.glob("*") if (p / "state.json").is_file()) if runs_dir.is_dir() else []
            )
            raise ConfigError(f"no run {run_id!r} to resume under {runs_dir}; known runs: {known or 'none'}")
        return cls(**json.loads(path.read_text()))


def run_of_flow_run(runs_dir: Path, flow_run_id: str) -> str | None:
    """The id of the run that Prefect flow run ``flow_run_id`` started, if it started one."""
    for path in sorted(runs_dir.glob("*/state.json")) if runs_dir.is_dir() else []:
        try:
            if json.loads(path.read_text()).get("flow_run_id") == flow_run_id:
                return path.parent.name
        except (OSError, ValueError):  # a state file being replaced, or not one of ours: not this run
            continue
    return None


def new_run_id(run_name: str) -> str:
    """``<name>-<UTC time>-<6 hex>``: readable, sorted by start, unique for runs started in one second."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '-', run_name)}-{stamp}-{secrets.token_hex(3)}"


_HELD: set[str] = set()  # run locks this process holds (a second flock of the file here would refuse itself)


@contextlib.contextmanager
def run_lock(runs_dir: Path, run_id: str, *, reentrant: bool = False) -> Iterator[None]:
    """Hold ``run_id``'s lock for the block; a ConfigError at once when another process holds it.

    Two processes resuming one run would both run its next iteration (its rollouts twice, two checkpoints
    of one version), so the second is refused rather than made to wait behind a run of hours. With
    ``reentrant``, a process that holds it already goes on holding it to the outer block's end."""
    path = runs_dir / run_id / "run.lock"
    key = str(path.resolve())
    if reentrant and key in _HELD:  # held here already (the flow process's main, then its flow): nested
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise ConfigError(
                f"run {run_id} is already running (process {holder}); wait for it to finish, or stop that "
                f"process and then `clawpipe run --resume {run_id}`"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        _HELD.add(key)
        try:
            yield
        finally:
            _HELD.discard(key)
    finally:
        os.close(fd)  # releases the lock
