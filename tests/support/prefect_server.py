"""A real Prefect server for the tests that deploy flows and run workers: started in its own session with
its output in a log, and waited for until its API answers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def server_env(root: Path, api: str) -> dict[str, str]:
    """The environment of a Prefect server, and of the clawpipe commands that use it, for one test under
    ``root``: this process's variables without its Prefect, MLflow and clawpipe settings, a home and a Prefect
    home of the test's own, the API at ``api``, no telemetry, unbuffered output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "CLAWPIPE_"))}
    env.update(
        {
            "CLAWPIPE_HOME": str(root / "home"),
            "PREFECT_HOME": str(root / "prefect"),
            "PREFECT_API_URL": api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "true",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``cmd`` in a session of its own (so a test can signal its whole process group), output to ``log``."""
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def start_server(port: int, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return spawn(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, log
    )


def wait_until_healthy(api: str, server: subprocess.Popen[bytes], log: Path, timeout_s: float = 180) -> None:
    """Until ``api``/health answers 200; fails with the server's log when it exits or never answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                return
        assert server.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"prefect server did not answer: {log.read_text()[-3000:]}")


@contextlib.contextmanager
def running_server(root: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A Prefect server of its own under ``root`` for the block: (its API URL, the environment to use it)."""
    from clawpipe.net import free_port

    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = server_env(root, api)
    server = start_server(port, env, root / "server.log")
    try:
        wait_until_healthy(api, server, root / "server.log")
        yield api, env
    finally:  # the server runs in a session of its own: its whole group goes (its workers too)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()
