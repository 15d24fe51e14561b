"""Run a reference harness as a plain subprocess with the environment the runner gives it (docs/ARCHITECTURE.md,
contract C),
against the scripted vLLM-shaped upstream (tests/support/upstream.py), then score it with its verifier."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clawpipe.sandbox.backends import get_backend
from clawpipe.sandbox.verify import verify_rollout
from clawpipe.tasks import get_task_set
from tests.support.upstream import ScriptedUpstream

HARNESSES = Path(__file__).resolve().parents[2] / "harnesses"
KEY = "k-test-rollout-key"


@dataclass
class Run:
    proc: subprocess.CompletedProcess[str]
    workdir: Path
    reward: float
    info: dict[str, Any]
    bodies: list[dict[str, Any]]  # JSON bodies of the model calls, in order
    paths: list[str]

    @property
    def transcript(self) -> dict[str, Any]:
        return json.loads((self.workdir / "out" / "transcript.json").read_text())


def manifest(name: str) -> dict[str, Any]:
    return tomllib.loads((HARNESSES / name / "harness.toml").read_text())


def harness_env(upstream: ScriptedUpstream, task_file: Path, workdir: Path, extra: dict[str, str]) -> dict[str, str]:
    # The runner's base URLs carry /r/<key> for the proxy; the scripted upstream serves /v1 directly.
    return {
        "OPENAI_BASE_URL": f"{upstream.url}/v1",
        "OPENAI_API_KEY": KEY,
        "ANTHROPIC_BASE_URL": upstream.url,
        "ANTHROPIC_API_KEY": KEY,
        "CLAWPIPE_MODEL": "policy",
        "OPENAI_MODEL": "policy",
        "ANTHROPIC_MODEL": "policy",
        "CLAWPIPE_TASK": str(task_file),
        "CLAWPIPE_WORKDIR": str(workdir),
        "CLAWPIPE_OUTPUT": str(workdir / "out"),
        "HOME": str(workdir / "home"),
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        **extra,
    }


def run_harness(name: str, task: dict[str, Any], upstream: ScriptedUpstream, tmp_path: Path) -> Run:
    """Run harness ``name`` on ``task`` against ``upstream`` in a fresh work dir, then verify the result."""
    spec = manifest(name)
    workdir = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}"
    (workdir / "out").mkdir(parents=True)
    (workdir / "home").mkdir()
    task_set = get_task_set(task["task_set"])
    task_set.prepare(task, workdir)
    task_file = workdir.with_suffix(".json")
    task_file.write_text(json.dumps(task))
    command = list(spec["command"])
    command[0] = sys.executable if command[0] in ("python3", "python") else command[0]
    command[1:] = [str(HARNESSES / name / a) if (HARNESSES / name / a).is_file() else a for a in command[1:]]
    before = len(upstream.requests)
    env = harness_env(upstream, task_file, workdir, spec.get("env", {}))
    proc = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=spec["timeout_s"])
    # the same verification the runner does: a task set that runs work-dir code is checked in a fresh sandbox
    reward, info = verify_rollout(task_set, task, workdir, get_backend("bwrap"))
    seen = [r for r in upstream.requests[before:] if r.method == "POST"]
    return Run(proc, workdir, reward, info, [r.json() for r in seen], [r.path for r in seen])
