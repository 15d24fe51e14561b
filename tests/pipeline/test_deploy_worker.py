"""Scheduling: a real Prefect server on loopback, `clawpipe deploy`, a triggered run, a worker completes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from clawpipe.net import free_port
from tests.support.prefect_server import server_env, spawn, start_server, wait_until_healthy

pytestmark = [pytest.mark.slow]

CONFIG = """
run_name = "scheduled"
experiment = "deploy"
iterations = 1
groups = 1
samples = 2
eval_tasks = 0
backend = "process"
[[harnesses]]
name = "chat-loop"
task_set = "guess"
"""


def test_deployment_run_is_completed_by_a_worker(tmp_path: Path) -> None:
    home = tmp_path / "home"
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = server_env(tmp_path, api)
    server = start_server(port, env, tmp_path / "server.log")
    worker = None
    try:
        wait_until_healthy(api, server, tmp_path / "server.log")
        cfg = tmp_path / "p.toml"
        cfg.write_text(CONFIG)
        cli = [sys.executable, "-m", "clawpipe"]
        out = subprocess.run(
            [*cli, "deploy", "--config", str(cfg), "--cron", "0 3 * * *", "--api-url", api],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "deployment pipeline/clawpipe-pipeline" in out.stdout
        deps = httpx.post(f"{api}/deployments/filter", json={}, timeout=10).json()
        (dep,) = [d for d in deps if d["name"] == "clawpipe-pipeline"]
        assert dep["schedules"] and dep["schedules"][0]["schedule"]["cron"] == "0 3 * * *"
        run = httpx.post(f"{api}/deployments/{dep['id']}/create_flow_run", json={}, timeout=10).json()
        worker = spawn([*cli, "worker", "--pool", "clawpipe", "--api-url", api], env, tmp_path / "worker.log")
        state = None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            state = httpx.get(f"{api}/flow_runs/{run['id']}", timeout=10).json()["state"]["type"]
            if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                break
            time.sleep(2)
        assert state == "COMPLETED", (tmp_path / "worker.log").read_text()[-5000:]
        states = list((home / "runs").glob("scheduled-*/state.json"))
        assert len(states) == 1
        assert json.loads(states[0].read_text())["policy_version"] == 1
    finally:
        for p in (worker, server):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
