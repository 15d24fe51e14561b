"""A `clawpipe run` cancelled through Prefect as the UI does it (the flow run's state set to Cancelling): the
run stops (sandboxes, policy server, proxy, training process), ends Cancelled in Prefect and KILLED in
MLflow, frees its lock, and `--resume` finishes it with every iteration's rollouts, calls and metric points
exactly once."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from clawpipe.net import free_port
from clawpipe.pipeline.state import run_lock
from tests.support.prefect_server import server_env, spawn, start_server, wait_until_healthy
from tests.support.procs import descendants

pytestmark = [pytest.mark.slow, pytest.mark.sandbox]

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 3
CONFIG = """
run_name = "cancelled"
experiment = "operated"
mode = "{mode}"
iterations = {iterations}
groups = 2
samples = 4
concurrency = 2
eval_tasks = 0
backend = "bwrap"
[[harnesses]]
name = "chat-loop"
task_set = "guess"
"""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _left_running(pids: list[int], home: Path, session: int) -> list[str]:
    """Processes of the run still there: any of ``pids``, any in the run's session, any naming its home."""
    left = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or not _alive(int(entry)):
            continue
        pid = int(entry)
        with contextlib.suppress(OSError, IndexError):
            sid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
            if pid in pids or sid == session or str(home) in _cmdline(pid):
                left.append(f"{pid}: {_cmdline(pid)[:200]}")
    return left


def _flow_runs(api: str, name: str) -> list[dict[str, object]]:
    body = {"flows": {"name": {"any_": [name]}}, "sort": "START_TIME_ASC"}
    return list(httpx.post(f"{api}/flow_runs/filter", json=body, timeout=10).json())


def _lake_check(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "clawpipe", "lake", "check"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)


def _completed(home: Path) -> int:
    states = list(home.glob("runs/*/state.json"))
    return len(json.loads(states[0].read_text())["completed"]) if states else 0


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("mode", "target"), [("sync", "pipeline"), ("async", "pipeline"), ("sync", "iteration"), ("async", "trainer")]
)
def test_a_run_cancelled_through_prefect_stops_whole_and_resumes_exactly_once(
    tmp_path: Path, mode: str, target: str
) -> None:
    # before: nothing acted on the Cancelling state; the run went on to its end (Completed over the cancel).
    # In async mode the producer's rollouts and the trainer's step run in worker threads of one event loop.
    # ``target``: the flow run cancelled, the run's own or one of the subflows the UI shows beside it (before,
    # a cancelled subflow stayed Cancelling while the run went on)
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = server_env(tmp_path, api)
    home = Path(env["CLAWPIPE_HOME"])
    server = start_server(port, env, tmp_path / "server.log")
    run = None
    try:
        wait_until_healthy(api, server, tmp_path / "server.log")
        cfg = tmp_path / "p.toml"
        cfg.write_text(CONFIG.format(mode=mode, iterations=ITERATIONS))
        cli = [sys.executable, "-m", "clawpipe", "run"]
        run = spawn([*cli, "--config", str(cfg)], env, tmp_path / "run.log")
        # cancel while a later iteration's sandboxes run: one iteration done, bwrap among the run's processes
        deadline, procs = time.monotonic() + 600, []
        while time.monotonic() < deadline:
            assert run.poll() is None, (tmp_path / "run.log").read_text()[-4000:]
            procs = descendants(run.pid)
            if _completed(home) >= 1 and any(_cmdline(p).split(" ")[0].endswith("/bwrap") for p in procs):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("no iteration with running sandboxes: " + (tmp_path / "run.log").read_text()[-3000:])
        (flow_run,) = _flow_runs(api, "pipeline")
        (cancelled,) = [r for r in _flow_runs(api, target) if r["state_type"] == "RUNNING"]
        cancel = {"state": {"type": "CANCELLING", "name": "Cancelling"}, "force": True}
        r = httpx.post(f"{api}/flow_runs/{cancelled['id']}/set_state", json=cancel, timeout=10)
        assert r.status_code in (200, 201), r.text
        assert run.wait(timeout=120) == 1
        log = (tmp_path / "run.log").read_text()
        (state_file,) = home.glob("runs/*/state.json")
        run_id = state_file.parent.name
        assert f"run {run_id} cancelled; continue it with `clawpipe run --resume {run_id}`" in log
        assert "was cancelled through Prefect: stopping the run" in log and "Traceback" not in log
        # nothing of the run is left: its sandboxes, policy server, proxy and training process stopped
        deadline = time.monotonic() + 30
        while (left := _left_running(procs, home, run.pid)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, left
        for cut in (flow_run, cancelled):  # the run, and the subflow cancelled: Cancelled, not Crashed
            state = httpx.get(f"{api}/flow_runs/{cut['id']}", timeout=10).json()["state"]
            assert state["type"] == "CANCELLED", (cut["name"], state)
        # and every subflow the stop cut short (before: left Crashed, or Running in async mode)
        every = httpx.post(f"{api}/flow_runs/filter", json={}, timeout=10).json()
        flows = {f["id"]: f["name"] for f in httpx.post(f"{api}/flows/filter", json={}, timeout=10).json()}
        cut_short = [(flows[r["flow_id"]], r["state_type"]) for r in every if r["state_type"] != "COMPLETED"]
        assert cut_short and all(state == "CANCELLED" for _, state in cut_short), cut_short
        cut_at = _completed(home)
        assert 1 <= cut_at < ITERATIONS

        import mlflow

        uri = f"sqlite:///{home / 'mlflow.db'}"
        client = mlflow.MlflowClient(tracking_uri=uri)
        mlflow_run_id = json.loads(state_file.read_text())["mlflow_run_id"]
        assert client.get_run(mlflow_run_id).info.status == "KILLED"
        with run_lock(home / "runs", run_id):  # released
            pass
        assert _lake_check(env).returncode == 0, _lake_check(env).stdout[-3000:]  # nothing half-visible

        resumed = subprocess.run(
            [*cli, "--resume", run_id], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT
        )
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        final = json.loads(state_file.read_text())
        assert len(final["completed"]) == ITERATIONS and final["policy_version"] == ITERATIONS
        assert client.get_run(mlflow_run_id).info.status == "FINISHED"
        for key in ("reward/mean", "train/policy_version"):  # one point per iteration
            steps = sorted(m.step for m in client.get_metric_history(mlflow_run_id, key))
            assert steps == list(range(ITERATIONS)), (key, steps)
        for key in client.get_run(mlflow_run_id).data.metrics:  # and no metric twice at a step
            steps = [m.step for m in client.get_metric_history(mlflow_run_id, key)]
            assert len(steps) == len(set(steps)), (key, sorted(steps))

        check = _lake_check(env)
        assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
        from clawpipe.tables import connect

        con = connect(home / "lake", tables=("model_calls", "rollouts"))
        calls, distinct = con.execute("select count(*), count(distinct call_id) from model_calls").fetchone() or (0, 0)
        assert calls == distinct > 0
        rows = con.execute("select iteration, rollout_id, status from rollouts").fetchall()
        for it in range(ITERATIONS):  # each planned rollout once, under its own id or one later attempt's
            specs = [re.sub(r"\.a\d+$", "", rid) for i, rid, status in rows if i == it and status != "infra_error"]
            assert len(specs) == len(set(specs)) == 8, (it, rows)
    finally:
        for p in (run, server):
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
