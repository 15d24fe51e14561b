"""A private Docker engine for tests: started where docker.io is installed and no engine answers.

Flags from docs/ARCHITECTURE.md (pitfalls: private Docker engine): no iptables, no bridge, private data/exec roots
and socket, so the host network
and any other engine are left alone. Stopped by its PID when the test session ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any


def engine_answers(host: str | None) -> bool:
    import docker

    try:
        client = docker.DockerClient(base_url=host) if host else docker.from_env()
        client.ping()
        client.close()
        return True
    except Exception:
        return False


class PrivateDockerd:
    """Owns one dockerd process; ``host`` is the DOCKER_HOST to use."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="cpd-", dir="/tmp"))
        self.sock = self.root / "d.sock"
        self.host = f"unix://{self.sock}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> str:
        dockerd = shutil.which("dockerd")
        if dockerd is None:
            raise RuntimeError("dockerd not found: apt-get install -y docker.io (make setup does this as root)")
        with open(self.root / "dockerd.log", "wb") as log:
            self.proc = self._spawn(dockerd, log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dockerd exited: {(self.root / 'dockerd.log').read_text()[-2000:]}")
            if engine_answers(self.host):
                return self.host
            time.sleep(0.2)
        raise RuntimeError(f"dockerd did not answer in {timeout}s: {(self.root / 'dockerd.log').read_text()[-2000:]}")

    def _spawn(self, dockerd: str, log: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                dockerd,
                "--iptables=false",
                "--ip-forward=false",
                "--bridge=none",
                f"--data-root={self.root / 'data'}",
                f"--exec-root={self.root / 'x'}",
                f"--pidfile={self.root / 'd.pid'}",
                "-H",
                self.host,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        subprocess.run(["umount", "-R", str(self.root / "data")], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)
