"""The process backend: no isolation, for debugging harnesses (explicit opt-in).

The harness runs as the runner's own user in its own session, with a cleared environment, cwd = the work
dir, and the same resource limits (cgroup where writable, else rlimits). It reaches the proxy through
a host-side bridge listener on an ephemeral 127.0.0.1 port, so requests are still counted per rollout;
nothing stops it from reaching anything else. The timeout kills the cgroup (daemonised descendants
included) or, without cgroups, the process group.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time

from clawpipe.errors import SandboxError
from clawpipe.sandbox.backends.base import (
    Outcome,
    PythonEnv,
    SandboxJob,
    decode_wait_status,
    harness_env,
    wait_for_exit,
)
from clawpipe.sandbox.bridge import Bridge, listen_on_host
from clawpipe.sandbox.limits import Cgroup, CgroupLayout, apply_rlimits, detect_cgroups, sweep_stale_cgroups

logger = logging.getLogger(__name__)


class ProcessBackend:
    """Run harnesses as plain child processes (no sandbox)."""

    name = "process"

    def __init__(self, *, python: PythonEnv | None = None, cgroups: CgroupLayout | None = None) -> None:
        self.python = python or PythonEnv.current()
        self.cgroups = cgroups if cgroups is not None else detect_cgroups()
        sweep_stale_cgroups(self.cgroups)

    def run(self, job: SandboxJob, bridge: Bridge) -> Outcome:
        t0 = time.monotonic()
        out = Outcome()
        route = bridge.attach(listen_on_host())
        cgroup: Cgroup | None = None
        proc: subprocess.Popen[bytes] | None = None
        gate_r, gate_w = os.pipe()
        try:
            env = harness_env(
                job,
                port=route.port,
                workdir=str(job.workdir),
                task_path=str(job.task_path),
                path_dirs=[str(self.python.bin)],
            )
            argv = job.manifest.resolve_command(job.manifest.dir)
            # A shell gate holds the harness until it is in its cgroup, so no descendant escapes the limits.
            gate = 'read _; exec "$@" </dev/null'
            with open(job.stdout_path, "wb") as so, open(job.stderr_path, "wb") as se:
                proc = subprocess.Popen(
                    ["/bin/sh", "-c", gate, "sh", *argv],
                    cwd=job.workdir,
                    env=env,
                    stdin=gate_r,
                    stdout=so,
                    stderr=se,
                    start_new_session=True,
                )
            os.close(gate_r)
            gate_r = -1
            try:
                cgroup = Cgroup(job.unique_name("clawpipe"), job.limits, self.cgroups)
                cgroup.add(proc.pid)
                missing = {"memory", "cpu", "pids"} - cgroup.controllers
            except OSError as exc:
                raise SandboxError(f"cgroup setup failed for {job.rollout_id}: {exc}") from exc
            if missing:
                apply_rlimits(proc.pid, job.limits, missing, job.timeout_s)
            os.write(gate_w, b"go\n")
            out.setup_ms = (time.monotonic() - t0) * 1000
            rc = wait_for_exit(proc, job.timeout_s)
            if rc is None:
                out.timed_out = True
            else:
                out.exit_code, out.signal = decode_wait_status(rc)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if cgroup is not None:
                cgroup.kill_all()
                out.oom = cgroup.oom_killed()
                out.pids_limited = cgroup.pids_limited()
            proc.wait()
            return out
        except SandboxError:
            raise
        except OSError as exc:
            raise SandboxError(f"process for {job.rollout_id} failed to start: {exc}") from exc
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            out.requests = route.requests
            out.notes.extend(route.errors)
            out.proxy_unreachable = route.unreachable
            bridge.detach(route)
            if cgroup is not None:
                cgroup.remove()
            for fd in (gate_r, gate_w):
                if fd >= 0:
                    os.close(fd)

    def close(self) -> None:
        pass
