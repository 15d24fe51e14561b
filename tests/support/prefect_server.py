"""A real Prefect server for the tests that deploy flows and run workers: started in its own session with
its output in a log, and waited for until its API answers."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx


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
