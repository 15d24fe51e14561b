"""The endpoint gone: each CLI is ended at the outer timeout with every process it started.

Codex and Qwen Code retry a refused connection forever and all three wait on an endpoint that accepts
and never answers, so only the outer limit ends them. The launcher's own deadline
(CLAWPIPE_TIMEOUT_S) and the runner's signal (SIGTERM to the launcher's group) are both checked.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli_harnesses.support import (
    HARNESSES,
    REPO,
    Blackhole,
    closed_port_url,
    harness_env,
    pids_in,
    run_launcher,
    write_task,
)

LIMIT_S = 3.0
# OpenClaw takes ~8 s (up to ~25 s on a loaded machine) to reach its first request: its limit lies past that,
# so that it is ended while it waits on the endpoint, not while it starts.
LIMITS_S = {"openclaw": 40.0}


@pytest.mark.slow
@pytest.mark.parametrize("harness", HARNESSES)
def test_hanging_endpoint_ends_at_the_launcher_deadline(harness: str, tmp_path: Path, cli_installed: None) -> None:
    workdir = tmp_path / "work"
    task = write_task(tmp_path / "task.json")
    limit = LIMITS_S.get(harness, LIMIT_S)
    hole = Blackhole()
    try:
        env = harness_env(
            hole.url, workdir, task, extra={"CLAWPIPE_CLI_MODE": "minimal", "CLAWPIPE_TIMEOUT_S": str(limit)}
        )
        result = run_launcher(harness, env, workdir, timeout=limit + 60)
    finally:
        hole.close()
    assert result.returncode == 124, result.stderr[-2000:]
    assert f"timeout after {limit:.0f}s" in result.stderr
    assert limit <= result.seconds < limit + 8
    assert pids_in(workdir) == [], "every process of the rollout is gone"


@pytest.mark.slow
def test_refused_endpoint_codex_reconnects_until_the_runner_stops_it(tmp_path: Path, cli_installed: None) -> None:
    """Like the runner: the launcher as a session leader, SIGTERM to its process group at the limit."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    task = write_task(tmp_path / "task.json")
    env = harness_env(closed_port_url(), workdir, task, extra={"CLAWPIPE_CLI_MODE": "minimal"})
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "harnesses" / "codex" / "launch.py")],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=LIMIT_S)  # still reconnecting: nothing but the outer limit ends it
        assert len(pids_in(workdir)) >= 2, "launcher + CLI running"
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = proc.stdout.read().decode() if proc.stdout else ""
    assert code in (128 + signal.SIGTERM, -signal.SIGTERM)
    assert time.monotonic() - t0 < 5
    assert "turn.started" in out, "codex started its turn and kept retrying the connection"
    assert pids_in(workdir) == []
