"""A deployment as operators drive it from the Prefect UI: runs whose parameters were edited with wrong types
or unknown keys, a run of a run id that another process is running, and a flow run retried after its
worker was killed mid-run. A real Prefect server, `clawpipe deploy` and `clawpipe worker` on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.prefect_server import running_server, spawn
from tests.support.procs import descendants

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """
run_name = "operated"
experiment = "operated"
iterations = 1
groups = 1
samples = 2
eval_tasks = 0
backend = "process"
[[harnesses]]
name = "chat-loop"
task_set = "guess"
"""
HOLDER = """
import sys, time
from pathlib import Path
from clawpipe.pipeline.state import run_lock
with run_lock(Path(sys.argv[1]), sys.argv[2]):
    print("held", flush=True)
    time.sleep(600)
"""
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


@dataclass
class Deployed:
    api: str
    env: dict[str, str]
    home: Path
    deployment_id: str
    cfg: dict[str, object]
    tmp: Path

    def start_worker(self, name: str = "worker") -> subprocess.Popen[bytes]:
        cli = [sys.executable, "-m", "clawpipe", "worker", "--pool", "clawpipe", "--api-url", self.api]
        return spawn(cli, self.env, self.tmp / f"{name}.log")

    def create_run(self, parameters: dict[str, object]) -> httpx.Response:
        body = {"parameters": parameters}
        return httpx.post(f"{self.api}/deployments/{self.deployment_id}/create_flow_run", json=body, timeout=10)

    def state(self, run_id: str) -> dict[str, object]:
        return dict(httpx.get(f"{self.api}/flow_runs/{run_id}", timeout=10).json()["state"])

    def wait_final(self, run_id: str, timeout_s: float = 300) -> dict[str, object]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.state(run_id)
            if state["type"] in FINAL:
                return state
            time.sleep(1)
        raise AssertionError(f"flow run {run_id} still {self.state(run_id)}")


def _stop(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    tmp = tmp_path_factory.mktemp("deployed")
    with running_server(tmp) as (api, env):
        (tmp / "p.toml").write_text(CONFIG)
        cli = [sys.executable, "-m", "clawpipe", "deploy", "--config", str(tmp / "p.toml"), "--api-url", api]
        out = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
        assert out.returncode == 0, out.stdout + out.stderr
        deps = httpx.post(f"{api}/deployments/filter", json={}, timeout=10).json()
        (dep,) = [d for d in deps if d["name"] == "clawpipe-pipeline"]
        yield Deployed(api, env, tmp / "home", dep["id"], dep["parameters"]["cfg"], tmp)


def _failed_with(deployed: Deployed, parameters: dict[str, object]) -> str:
    """The message a deployment run with ``parameters`` is refused or fails with (a worker runs it)."""
    created = deployed.create_run(parameters)
    if created.status_code >= 400:  # refused by the server before any worker took it
        return created.text
    worker = deployed.start_worker()
    try:
        state = deployed.wait_final(created.json()["id"])
    finally:
        _stop(worker)
    assert state["type"] == "FAILED", state
    return str(state["message"])


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ({"groups": "4"}, "groups"),
        ({"iterations": 2.5}, "iterations"),
        ({"harnesses": "chat-loop"}, "harnesses"),
        ({"learning_rat": 0.1}, "learning_rat"),
        ({"train": {"learning_rat": 0.1}}, "learning_rat"),
    ],
)
def test_a_deployment_run_with_edited_parameters_fails_naming_the_parameter(
    deployed: Deployed, edit: dict[str, object], named: str
) -> None:
    message = _failed_with(deployed, {"cfg": {**deployed.cfg, **edit}})
    assert named in message, message
    assert "Traceback" not in message and len(message) < 2000, message


def test_a_deployment_run_of_a_run_another_process_is_running_fails_at_once(deployed: Deployed) -> None:
    # before: a deployment run took no run lock (only `clawpipe run` did) and drove the run a second time
    from clawpipe.pipeline.state import RunState

    run_id = "held-20260101-000000-abcdef"
    state = RunState(run_id=run_id, config={**deployed.cfg}, policy_dir=str(deployed.home / "models" / "p"))
    state_file = state.save(deployed.home / "runs")
    before = state_file.read_bytes()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(deployed.home / "runs"), run_id], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        message = _failed_with(deployed, {"run_id": run_id, "resume": True})
    finally:
        holder.kill()
        holder.wait()
    assert f"run {run_id} is already running (process {holder.pid})" in message, message
    assert state_file.read_bytes() == before


def _completed(home: Path) -> list[Path]:
    return [p for p in home.glob("runs/*/state.json") if json.loads(p.read_text())["completed"]]


def _await_an_iteration(deployed: Deployed, run_name: str, flow_run_id: str, worker: subprocess.Popen[bytes]) -> None:
    """Until the worker's run of ``run_name`` has completed an iteration (at most 300 s, the worker alive)."""
    deadline = time.monotonic() + 300
    while not [p for p in _completed(deployed.home) if p.parent.name.startswith(f"{run_name}-")]:
        assert time.monotonic() < deadline and worker.poll() is None, deployed.state(flow_run_id)
        time.sleep(0.2)


def test_a_flow_run_retried_after_its_worker_was_killed_resumes_its_run(deployed: Deployed) -> None:
    # before: the retried flow run started a new run from the initial policy, the first one left half done
    import mlflow
    from clawpipe.tables import connect

    iterations = 3
    cfg = {**deployed.cfg, "run_name": "retried", "iterations": iterations, "groups": 2, "samples": 4}
    created = deployed.create_run({"cfg": {**cfg, "concurrency": 2}})
    assert created.status_code < 400, created.text
    flow_run_id = created.json()["id"]
    worker = deployed.start_worker("killed-worker")
    try:
        _await_an_iteration(deployed, "retried", flow_run_id, worker)
        for pid in [worker.pid, *descendants(worker.pid)]:  # the host went: worker and flow process alike
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        worker.wait()
    finally:
        _stop(worker, signal.SIGKILL)
    (state_file,) = [p for p in deployed.home.glob("runs/retried-*/state.json")]
    cut_at = len(json.loads(state_file.read_text())["completed"])
    assert cut_at < iterations and deployed.state(flow_run_id)["type"] == "RUNNING"
    retry = {"state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"}, "force": True}
    assert httpx.post(f"{deployed.api}/flow_runs/{flow_run_id}/set_state", json=retry, timeout=10).status_code < 400
    worker = deployed.start_worker("retry-worker")
    try:
        state = deployed.wait_final(flow_run_id, timeout_s=420)
    finally:
        _stop(worker)
    assert state["type"] == "COMPLETED", (deployed.tmp / "retry-worker.log").read_text()[-4000:]
    # the same run went on: one run, every iteration once, one MLflow run
    assert [p.parent.name for p in deployed.home.glob("runs/retried-*/state.json")] == [state_file.parent.name]
    final = json.loads(state_file.read_text())
    assert len(final["completed"]) == iterations and final["policy_version"] == iterations
    run_id = state_file.parent.name
    con = connect(deployed.home / "lake", tables=("rollouts",))
    query = "select iteration, count(*) from rollouts where run_id = $r and status != 'infra_error' group by 1"
    assert sorted(con.execute(query, {"r": run_id}).fetchall()) == [(it, 8) for it in range(iterations)]
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{deployed.home / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "operated"]
    assert len([r for r in client.search_runs([experiment.experiment_id]) if r.info.run_name == run_id]) == 1


def test_a_deployment_run_cancelled_in_the_ui_stops_on_its_worker(deployed: Deployed) -> None:
    import mlflow

    cfg = {**deployed.cfg, "run_name": "cancelled", "iterations": 4, "groups": 2, "samples": 4, "concurrency": 2}
    created = deployed.create_run({"cfg": cfg})
    assert created.status_code < 400, created.text
    flow_run_id = created.json()["id"]
    worker = deployed.start_worker("cancel-worker")
    try:
        _await_an_iteration(deployed, "cancelled", flow_run_id, worker)
        # the flow run's processes: everything under the worker but the Prefect worker process itself
        flow_procs = [p for p in descendants(worker.pid) if b"worker\0start" not in _cmdline(p)]
        cancel = {"state": {"type": "CANCELLING", "name": "Cancelling"}, "force": True}
        r = httpx.post(f"{deployed.api}/flow_runs/{flow_run_id}/set_state", json=cancel, timeout=10)
        assert r.status_code < 400, r.text
        state = deployed.wait_final(flow_run_id, timeout_s=120)
        assert state["type"] == "CANCELLED", state
        deadline = time.monotonic() + 30
        while (left := [p for p in flow_procs if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, [_cmdline(p)[:200] for p in left]
        assert worker.poll() is None  # the worker itself goes on taking runs
    finally:
        _stop(worker)
    (state_file,) = deployed.home.glob("runs/cancelled-*/state.json")
    mlflow_run_id = json.loads(state_file.read_text())["mlflow_run_id"]
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{deployed.home / 'mlflow.db'}")
    assert client.get_run(mlflow_run_id).info.status == "KILLED"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
