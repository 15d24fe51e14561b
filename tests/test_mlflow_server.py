"""The shared MLflow tracking server (mlflow/server.sh) with a database backend, on loopback: a run logged
through it by a client lands in its sqlite database and its artifact folder."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_server_sh_serves_runs_from_a_database(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    port = _free_port()
    db = tmp_path / "db" / "mlflow.db"
    artifacts = tmp_path / "artifacts"
    env = {
        **os.environ,
        "MLFLOW_BACKEND_STORE_URI": f"sqlite:///{db}",
        "MLFLOW_ARTIFACTS_DIR": str(artifacts),
    }
    proc = subprocess.Popen(
        ["bash", str(REPO / "mlflow" / "server.sh"), "127.0.0.1", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else "server exited"
            assert time.monotonic() < deadline, "mlflow server did not answer /health in 120 s"
            time.sleep(0.5)
        client = MlflowClient(tracking_uri=url)
        exp = client.create_experiment("shared")
        run = client.create_run(exp)
        client.log_param(run.info.run_id, "host", "hostA")
        for step, loss in enumerate([1.0, 0.5, 0.25]):
            client.log_metric(run.info.run_id, "loss", loss, step=step)
        client.log_text(run.info.run_id, "hello", "notes/hello.txt")
        client.set_terminated(run.info.run_id)

        other = MlflowClient(tracking_uri=url)  # a second worker sees the same run
        found = other.search_runs([exp])
        assert [r.info.run_id for r in found] == [run.info.run_id]
        assert found[0].data.params == {"host": "hostA"}
        assert [m.value for m in other.get_metric_history(run.info.run_id, "loss")] == [1.0, 0.5, 0.25]
        with sqlite3.connect(db) as con:  # the backend store is the database
            rows = con.execute("select run_uuid, status from runs").fetchall()
        assert rows == [(run.info.run_id, "FINISHED")]
        assert [p.read_text() for p in artifacts.rglob("hello.txt")] == ["hello"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
