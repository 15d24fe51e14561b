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
    confine,
    decode_wait_status,
    detach_route,
    harness_env,
    reap_cgroup,
    wait_for_exit,
)
from clawpipe.sandbox.bridge import Bridge, listen_on_host
from clawpipe.sandbox.limits import Cgroup, CgroupLayout, detect_cgroups, sweep_stale_cgroups

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
                kit_path=str(job.manifest.kit_dir),
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
            cgroup = confine(proc.pid, job, self.cgroups)
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
            reap_cgroup(cgroup, out)
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
            detach_route(bridge, route, out)
            if cgroup is not None:
                cgroup.remove()
            for fd in (gate_r, gate_w):
                if fd >= 0:
                    os.close(fd)

    def close(self) -> None:
        pass
