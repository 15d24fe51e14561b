"""The long-lived services of a run: the policy server and the capture proxy in front of it.

Both run as their own processes (``clawpipe serve``, ``clawpipe proxy``), so the run's process tree shows
where CPU and memory go, and a crash of one is visible as an exit code. Publishing a checkpoint pauses the
proxy (new calls wait, in-flight calls drain), reloads the server, and resumes the proxy with the new
policy_version stamped on every later call.

A worker host of a fanned-out run (clawpipe/pipeline/shards.py) has its own capture proxy in front of the
run's policy server(s): :func:`host_proxy` starts it on first use, under a lock, in a session of its own,
and later shards on the host reuse it. It belongs to the host, not to the shard or the Prefect worker
that started it: a worker killed mid-shard leaves it running, so the calls it already accepted are sealed
and uploaded, and the next shard on the host finds it. :func:`stop_host_proxies` ends them
(``clawpipe worker`` does on exit).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from clawpipe.errors import ServingError
from clawpipe.net import free_port

log = logging.getLogger(__name__)


@dataclass
class Services:
    """Handles of the serving engine and the proxy processes; use as a context manager."""

    policy_dir: Path
    capture_dir: Path
    log_dir: Path
    admin_token: str
    served_name: str = "clawpipe-policy"
    policy_version: int = 0
    engine: str = "local"  # local | vllm
    serve_host: str = "127.0.0.1"  # the policy server's bind address (worker hosts of a fan-out reach it there)
    serve_args: list[str] = field(default_factory=list)
    serving_url: str = ""
    proxy_url: str = ""
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, timeout: float = 120.0) -> Services:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        serve_port, proxy_port = free_port(), free_port()
        self.serving_url = f"http://{advertised_host(self.serve_host)}:{serve_port}"
        self.proxy_url = f"http://127.0.0.1:{proxy_port}"
        cli = [sys.executable, "-m", "clawpipe"]
        if self.engine == "vllm":
            # vLLM reloads by copying weights into the directory it serves: serve a run-local copy so the
            # initial policy is never overwritten.
            served = self.log_dir.parent / "served"
            if not served.exists():
                shutil.copytree(self.policy_dir, served)
            self.policy_dir = served
        self._spawn(
            "serving",
            [
                *cli,
                "serve",
                "--engine",
                self.engine,
                "--model",
                str(self.policy_dir),
                "--port",
                str(serve_port),
                "--host",
                self.serve_host,
                "--served-name",
                self.served_name,
                "--policy-version",
                str(self.policy_version),
                *self.serve_args,
            ],
        )
        self._spawn(
            "proxy",
            [
                *cli,
                "proxy",
                "--upstream",
                f"{self.serving_url}/v1",
                "--port",
                str(proxy_port),
                "--capture-dir",
                str(self.capture_dir),
                "--tokenizer",
                str(self.policy_dir),
                "--policy-version",
                str(self.policy_version),
                "--segment-age",
                "5",
            ],
        )
        self._wait(f"{self.serving_url}/health", "serving", timeout)
        self._wait(f"{self.proxy_url}/admin/health", "proxy", timeout)
        log.info("services up serving=%s proxy=%s", self.serving_url, self.proxy_url)
        return self

    def _spawn(self, name: str, cmd: list[str]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # Same process group as the run (a kill of the run's group ends them too) and a parent-death signal,
        # so a killed run never leaves a server holding its port. The child keeps its own copy of the log fd.
        with open(self.log_dir / f"{name}.log", "ab") as out:
            self._procs.append(
                subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
            )

    def _wait(self, url: str, name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        headers = {"authorization": f"Bearer {self.admin_token}"}
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.poll() is not None:
                    tail = _tail(self.log_dir)
                    raise ServingError(f"{name} exited with {p.returncode} while starting; log tail:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, headers=headers, timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise ServingError(f"{name} did not answer at {url} within {timeout:.0f}s; see {self.log_dir}/{name}.log")

    def stop(self) -> None:
        for p in reversed(self._procs):  # the proxy first: it seals its segment on SIGTERM
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self._procs.clear()

    def endpoints(self) -> dict[str, str]:
        """What the stages need to reach the services: engine and proxy URLs, the directory served."""
        return {"serving_url": self.serving_url, "proxy_url": self.proxy_url, "served_dir": str(self.policy_dir)}

    def __enter__(self) -> Services:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def advertised_host(bind: str) -> str:
    """The name other hosts reach a server bound to ``bind`` by: this host's name for a wildcard address."""
    if bind in ("0.0.0.0", "::", ""):
        import socket

        return socket.getfqdn()
    return bind


def _die_with_parent() -> None:
    import ctypes

    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _admin(url: str, token: str, body: dict[str, Any] | None = None, timeout: float = 300.0) -> dict[str, Any]:
    r = httpx.post(url, json=body or {}, headers={"authorization": f"Bearer {token}"}, timeout=timeout)
    if r.status_code != 200:
        raise ServingError(f"POST {url} answered {r.status_code}: {r.text[:500]}")
    return dict(r.json())


def publish(
    serving_url: str,
    proxy_url: str,
    admin_token: str,
    checkpoint: Path,
    policy_version: int,
    *,
    engine: str = "local",
    served_dir: Path | None = None,
) -> None:
    """Pause the proxy (new calls wait, in-flight drain), reload the engine, resume with the new version."""
    _admin(f"{proxy_url}/admin/pause", admin_token)
    try:
        if engine == "vllm":
            cmd = [
                sys.executable,
                "-m",
                "clawpipe",
                "model",
                "publish",
                str(checkpoint),
                "--engine",
                "vllm",
                "--url",
                serving_url,
                "--served-dir",
                str(served_dir),
                "--policy-version",
                str(policy_version),
            ]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise ServingError(f"vLLM reload failed: {done.stderr[-2000:]}")
        else:
            body = {"path": str(checkpoint), "policy_version": policy_version}
            _admin(f"{serving_url}/admin/reload", admin_token, body)
    finally:
        _admin(f"{proxy_url}/admin/resume", admin_token, {"policy_version": policy_version})
    log.info("published policy_version=%d from %s", policy_version, checkpoint)


def _tail(log_dir: Path) -> str:
    logs = sorted(log_dir.glob("*.log"), key=lambda f: f.stat().st_mtime)
    return "\n".join(f"[{f.name}] " + f.read_text(errors="replace")[-1500:] for f in logs[-2:])


def upstreams_of(proxy_url: str, admin_token: str) -> list[str]:
    """The policy servers behind a proxy (its ``/admin/replicas`` listing): what worker hosts' proxies front."""
    r = httpx.get(f"{proxy_url}/admin/replicas", headers={"authorization": f"Bearer {admin_token}"}, timeout=30)
    if r.status_code != 200:
        raise ServingError(f"GET {proxy_url}/admin/replicas answered {r.status_code}: {r.text[:300]}")
    return [str(rep["upstream"]) for rep in r.json()["replicas"]]


def host_proxy(
    home: Path, upstreams: list[str], admin_token: str, *, tokenizer: Path | None = None, timeout: float = 120.0
) -> str:
    """The URL of this host's capture proxy in front of ``upstreams``: the running one, or a new one.

    One per set of upstreams, recorded in ``<home>/proxies/<key>.json``; the lock makes two shards that
    start at once on the host share one. A recorded proxy that no longer answers is replaced.
    """
    folder = home / "proxies"
    folder.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha1("\n".join(sorted(u.rstrip("/") for u in upstreams)).encode()).hexdigest()[:12]
    record = folder / f"{key}.json"
    with open(folder / f"{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if record.is_file():
            known = json.loads(record.read_text())
            if _answers(str(known["url"]), admin_token):
                return str(known["url"])
        ready = folder / f"{key}.ready"
        ready.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "clawpipe", "proxy", "--port", "0", "--ready-file", str(ready)]
        for url in upstreams:
            cmd += ["--upstream", url]
        cmd += ["--capture-dir", str(home / "captures"), "--segment-age", "5"]
        if tokenizer is not None:
            cmd += ["--tokenizer", str(tokenizer)]
        with open(folder / f"{key}.log", "ab") as out:
            # its own session: a kill of the shard's or the worker's process group leaves the host's proxy
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                # the host's home (its HMAC secret, which the runner's keys are minted with) and this admin token
                env={
                    **os.environ,
                    "PYTHONUNBUFFERED": "1",
                    "CLAWPIPE_HOME": str(home),
                    "CLAWPIPE_ADMIN_TOKEN": admin_token,
                },
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not ready.is_file():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                tail = (folder / f"{key}.log").read_text(errors="replace")[-1500:]
                raise ServingError(f"the host proxy for {upstreams} did not start (exit {proc.poll()}):\n{tail}")
            time.sleep(0.1)
        url = ready.read_text().strip()
        tmp = record.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": proc.pid, "url": url, "upstreams": upstreams}))
        os.replace(tmp, record)
        log.info("host proxy up url=%s upstreams=%s pid=%d", url, upstreams, proc.pid)
        return url


def _answers(url: str, admin_token: str) -> bool:
    try:
        r = httpx.get(f"{url}/admin/health", headers={"authorization": f"Bearer {admin_token}"}, timeout=5)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def set_policy_version(proxy_url: str, admin_token: str, policy_version: int) -> None:
    """Stamp ``policy_version`` on the proxy's later calls (a host proxy serves the policy of its shard)."""
    _admin(f"{proxy_url}/admin/policy_version", admin_token, {"policy_version": policy_version}, timeout=30)


def stop_host_proxies(home: Path, timeout: float = 30.0) -> int:
    """SIGTERM every host proxy recorded under ``<home>/proxies`` (each seals and uploads its last segment)."""
    stopped = 0
    for record in sorted((home / "proxies").glob("*.json")):
        pid = int(json.loads(record.read_text())["pid"])
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            stopped += 1
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.1)
        record.unlink(missing_ok=True)
    return stopped


def _alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reap it when it is our child
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
