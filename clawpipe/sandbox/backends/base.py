"""What every sandbox backend receives (:class:`SandboxJob`) and returns (:class:`Outcome`).

A backend runs one harness process tree to its end or its timeout and reports how it ended; it raises
:class:`~clawpipe.errors.SandboxError` when the sandbox itself could not be set up (an infra error,
retried by the runner). Backends are chosen by name through :func:`get_backend`.
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from clawpipe.errors import SandboxError
from clawpipe.sandbox.bridge import Bridge, Route
from clawpipe.sandbox.limits import (
    Cgroup,
    CgroupLayout,
    Limits,
    apply_file_size_limit,
    apply_process_limits,
    apply_rlimits,
)
from clawpipe.sandbox.manifest import KIT_ENV, HarnessManifest, expand_env
from clawpipe.sandbox.uids import SHARED_GID, SHARED_UID, SHARED_USER, SandboxUser

SANDBOX_USER_NAME = "sandbox"
INNER_WORKDIR = "/workdir"
INNER_TASK = "/task.json"
INNER_HARNESS = "/harness"
INNER_KIT = "/harness-kit"  # the shared harness library (manifest.kit_dir), read-only, when there is one
BACKENDS = ("bwrap", "docker", "process")


@dataclass(frozen=True, slots=True)
class PythonEnv:
    """The Python environment harnesses run with (bound read-only into sandboxes)."""

    prefix: Path  # the venv (or the base install when there is none)
    base_prefix: Path  # the interpreter installation the venv points at

    @classmethod
    def current(cls) -> PythonEnv:
        return cls(prefix=Path(sys.prefix), base_prefix=Path(os.path.realpath(sys.base_prefix)))

    @property
    def bin(self) -> Path:
        return self.prefix / "bin"

    def mounts(self) -> list[Path]:
        """Distinct directories to bind, outermost first, skipping ones under /usr (bound anyway)."""
        out: list[Path] = []
        for p in (self.base_prefix, self.prefix):
            if p == Path("/usr") or Path("/usr") in p.parents or p in out:
                continue
            out.append(p)
        return out


@dataclass(slots=True)
class SandboxJob:
    """One harness execution, prepared on the host by the runner."""

    rollout_id: str
    manifest: HarnessManifest
    rollout_dir: Path  # host folder holding work/, task.json and the logs
    key: str
    model: str
    timeout_s: float
    limits: Limits
    user: SandboxUser = SHARED_USER  # host uid/gid the harness runs as (its work dir belongs to them)

    def unique_name(self, prefix: str) -> str:
        """``<prefix>-<rollout id, sanitised>-<random>``: unique even when runners share rollout ids."""
        tag = re.sub(r"[^a-zA-Z0-9_.-]", "_", self.rollout_id)[:60]
        return f"{prefix}-{tag}-{uuid.uuid4().hex[:8]}"

    @property
    def workdir(self) -> Path:
        return self.rollout_dir / "work"

    @property
    def task_path(self) -> Path:
        return self.rollout_dir / "task.json"

    @property
    def stdout_path(self) -> Path:
        return self.rollout_dir / "stdout.log"

    @property
    def stderr_path(self) -> Path:
        return self.rollout_dir / "stderr.log"


@dataclass(slots=True)
class Outcome:
    """How a harness process tree ended."""

    exit_code: int | None = None  # None when killed by a signal or never started
    signal: int | None = None
    timed_out: bool = False
    oom: bool = False
    pids_limited: bool = False
    requests: int = 0  # HTTP requests the bridge forwarded for this sandbox
    proxy_unreachable: int = 0  # connections the bridge could not forward (proxy down): an infra error
    refused: int = 0  # connections the bridge refused over its per-sandbox cap: an infra error, not retried
    setup_ms: float = 0.0
    notes: list[str] = field(default_factory=list)


class Backend(Protocol):
    name: str

    def run(self, job: SandboxJob, bridge: Bridge) -> Outcome: ...

    def close(self) -> None: ...


def takes_own_uids(backend: Backend) -> bool:
    """Whether ``backend`` runs each sandbox as the job's own uid: not the process backend (the runner's own
    user), nor one that says it cannot (``own_uids = False``: a rootless Docker engine), which use 65534."""
    return backend.name != "process" and bool(getattr(backend, "own_uids", True))


def identity_files(user: SandboxUser) -> tuple[str, str]:
    """/etc/passwd and /etc/group of a sandbox whose processes run as ``user``: it is "sandbox", beside root
    and, when it is another uid, the usual nobody/nogroup. Its home is the one $HOME names (the work dir's
    ``home``), so a tool that asks the user database rather than $HOME (ssh, some git and pip paths) finds
    the same writable folder."""
    home = f"{INNER_WORKDIR}/home"
    passwd = f"root:x:0:0:root:/root:/bin/sh\n{SANDBOX_USER_NAME}:x:{user.uid}:{user.gid}:sandbox:{home}:/bin/sh\n"
    group = f"root:x:0:\n{SANDBOX_USER_NAME}:x:{user.gid}:\n"
    if not user.shared:
        passwd += f"nobody:x:{SHARED_UID}:{SHARED_GID}:nobody:/nonexistent:/usr/sbin/nologin\n"
        group += f"nogroup:x:{SHARED_GID}:\n"
    return passwd, group


def harness_env(
    job: SandboxJob, *, port: int, workdir: str, task_path: str, path_dirs: list[str], kit_path: str = INNER_KIT
) -> dict[str, str]:
    """The complete environment of a harness (docs/ARCHITECTURE.md, contract C): declared variables plus the runner's
    own.

    ``kit_path`` is where the harness sees the shared harness library; it is exported as
    $CLAWPIPE_HARNESS_KIT only when the harness has one (``job.manifest.kit_dir``).
    """
    base = f"http://127.0.0.1:{port}/r/{job.key}"
    env = {"LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": "/tmp"}
    # the name older openai SDKs, LangChain and LiteLLM read the endpoint from; a manifest may set it otherwise
    env["OPENAI_API_BASE"] = f"{base}/v1"
    runner = {
        "OPENAI_BASE_URL": f"{base}/v1",
        "OPENAI_API_KEY": job.key,
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": job.key,
        "CLAWPIPE_MODEL": job.model,
        "OPENAI_MODEL": job.model,
        "ANTHROPIC_MODEL": job.model,
        "CLAWPIPE_TASK": task_path,
        "CLAWPIPE_WORKDIR": workdir,
        "CLAWPIPE_OUTPUT": f"{workdir}/out",
        "HOME": f"{workdir}/home",
        "PATH": ":".join([*path_dirs, "/usr/local/bin", "/usr/bin", "/bin"]),
        "CLAWPIPE_TIMEOUT_S": str(job.timeout_s),
    }
    if job.manifest.kit_dir is not None:
        runner[KIT_ENV] = kit_path
    # declared variables may override the defaults above, not the runner's own; they may refer to those
    env.update({k: expand_env(v, runner) for k, v in job.manifest.env.items()})
    env.update(runner)
    return env


def wait_for_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """The return code, or None if ``proc`` is still running after ``timeout_s``.

    Uses a pidfd, so the exit is seen at once; Popen.wait(timeout) polls with sleeps of up to 50 ms,
    which would add tens of milliseconds to every rollout.
    """
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(max(0, int(timeout_s * 1000))):
            return None
    finally:
        os.close(fd)
    return proc.wait()


def decode_wait_status(returncode: int) -> tuple[int | None, int | None]:
    """(exit_code, signal) from a Popen returncode (negative = killed by that signal)."""
    if returncode < 0:
        return None, -returncode
    return returncode, None


def decode_shell_status(code: int) -> tuple[int | None, int | None]:
    """(exit_code, signal) from a shell-style status (bwrap's, a container's): above 128 = killed by code - 128."""
    if code > 128:
        return None, code - 128
    return code, None


def confine(pid: int, job: SandboxJob, layout: CgroupLayout) -> Cgroup:
    """Put ``pid`` (not yet running the harness) into a new cgroup with the job's limits; rlimits stand in for
    the controllers the cgroup lacks; file sizes, open files and core dumps are capped by rlimits in any case.
    Raises SandboxError when the cgroup cannot be set up.

    The caller owns the returned cgroup: it reaps it with :func:`reap_cgroup` and removes it.
    """
    cgroup = None
    try:
        try:
            cgroup = Cgroup(job.unique_name("clawpipe"), job.limits, layout)
            cgroup.add(pid)
            missing = {"memory", "cpu", "pids"} - cgroup.controllers
        except OSError as exc:
            raise SandboxError(f"cgroup setup failed for {job.rollout_id}: {exc}") from exc
        if missing:
            apply_rlimits(pid, job.limits, missing, job.timeout_s, shared_uid=job.user.shared)
        apply_file_size_limit(pid, job.limits)
        apply_process_limits(pid)
    except BaseException:
        if cgroup is not None:
            cgroup.remove()  # kills whatever got in, then removes the group
        raise
    return cgroup


def reap_cgroup(cgroup: Cgroup, out: Outcome) -> None:
    """Kill whatever is left in a sandbox's cgroup and record in ``out`` whether its limits were hit."""
    cgroup.kill_all()
    out.oom = cgroup.oom_killed()
    out.pids_limited = cgroup.pids_limited()


def detach_route(bridge: Bridge, route: Route, out: Outcome) -> None:
    """Record in ``out`` what passed through a sandbox's route, then stop forwarding it."""
    out.requests = route.requests
    out.notes.extend(route.errors)
    out.proxy_unreachable = route.unreachable
    out.refused = route.refused
    if route.refused:
        out.notes.append(
            f"the bridge refused {route.refused} connections over the sandbox's cap of {route.max_connections} "
            f"open at once (it held at most {route.peak_open})"
        )
    bridge.detach(route)
