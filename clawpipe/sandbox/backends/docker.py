"""The docker backend: each rollout in a container with --network none plus the bridge, no registry needed.

Image: ``clawpipe-sandbox:<hash>``, built locally on first use by ``docker import`` of a nearly empty root
filesystem (directories, the /bin -> usr/bin symlinks, hosts, passwd/group that know uid 65534); /usr,
the Python environment, the harness folder (/harness), the task (/task.json), the work dir (/workdir,
rw) and /etc/passwd and /etc/group naming the job's uid "sandbox" are bind mounts, everything else is
read-only (``read_only=True``, private /tmp tmpfs).

Network: a small *holder* container (``sleep infinity``, network none) owns the network namespace; the
host opens the bridge listener inside it (State.Pid) and the harness container joins it with
``network_mode=container:<holder>`` (the pod pattern), so the listener exists before the harness runs.
Limits: mem_limit (= memswap), nano_cpus, pids_limit, open files, no core dumps; cap_drop ALL, no-new-privileges,
the engine's seccomp profile with the bwrap backend's filter stacked on it (clawpipe.sandbox.seccomp),
and the job's own host uid/gid (clawpipe.sandbox.uids), so no kernel per-uid budget is shared with a neighbour;
a rootless or userns-remapping engine maps no such uid, so there every container runs as 65534 (with a warning).
The harness's environment (its key among it) is not given to Docker, whose ``docker inspect`` shows a
container's Env to anyone who can reach the engine: it is written to a file in the rollout folder (mode
0400, owned by the sandbox user), bound read-only at ``/run/clawpipe.env``, and sourced by ``/bin/sh``
just before it execs the harness; the file is removed when the container ends.
The SDK's ``container.wait(timeout=...)`` raises requests' ConnectionError/ReadTimeout on timeout
(NOTES): that is the timeout path, after which the container is killed. Both containers are removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import shlex
import shutil
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import docker
import docker.errors
import docker.types
import requests.exceptions

from clawpipe.errors import SandboxError
from clawpipe.sandbox.backends.base import (
    INNER_HARNESS,
    INNER_KIT,
    INNER_TASK,
    INNER_WORKDIR,
    Outcome,
    PythonEnv,
    SandboxJob,
    decode_shell_status,
    detach_route,
    harness_env,
    identity_files,
)
from clawpipe.sandbox.bridge import Bridge, listen_in_netns
from clawpipe.sandbox.limits import SANDBOX_NOFILE
from clawpipe.sandbox.seccomp import loader_command
from clawpipe.sandbox.uids import SHARED_USER, SandboxUser

logger = logging.getLogger(__name__)

IMAGE_REPO = "clawpipe-sandbox"
LABEL = "clawpipe.sandbox"
ETC_BINDS = ("ld.so.cache", "localtime", "alternatives", "ssl", "ca-certificates")
INNER_ENV = "/run/clawpipe.env"
LOG_MAX_MB = 8  # what the engine keeps of a harness's output (the latest part); never more than a quarter of the quota
# POSIX sh: export everything the file assigns, then become the harness (argv after "sh").
ENV_LAUNCHER = ["/bin/sh", "-c", f'set -a; . {INNER_ENV}; set +a; exec "$@"', "sh"]
_image_lock = threading.Lock()


def _rootfs_tar() -> bytes:
    """A minimal root filesystem: empty mount points, /bin-style symlinks into /usr, identity files."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:

        def add_dir(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)

        def add_file(name: str, text: str) -> None:
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))

        for d in ("usr", "etc", "dev", "proc", "sys", "root", "workdir", "harness", "run"):
            add_dir(d)
        add_dir("tmp", 0o1777)
        for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            host = Path("/") / top
            if host.is_symlink():
                info = tarfile.TarInfo(top)
                info.type, info.linkname = tarfile.SYMTYPE, str(host.readlink())
                tar.addfile(info)
            elif host.is_dir():  # a real directory on this host: bound read-only at run time
                add_dir(top)
        passwd, group = identity_files(SHARED_USER)  # the holder's; a harness gets its uid's files bound over them
        add_file("etc/passwd", passwd)
        add_file("etc/group", group)
        add_file("etc/hosts", "127.0.0.1 localhost\n::1 localhost\n")
        add_file("etc/nsswitch.conf", "passwd: files\ngroup: files\nhosts: files\n")
        add_file("etc/resolv.conf", "")
        add_file("task.json", "")
    return buf.getvalue()


def maps_host_uids(security_options: list[str]) -> bool:
    """Whether an engine runs containers as the host uids they name: not rootless and without userns-remap
    (``docker info``'s SecurityOptions), where only uids inside a 65536-wide subordinate range exist."""
    return not any("name=rootless" in o or "name=userns" in o for o in security_options)


def ensure_image(client: docker.DockerClient, name: str | None = None) -> str:
    """Import the sandbox image into this engine unless it is there already; returns its name.

    The default name is tagged with a hash of the root filesystem, so a changed skeleton gets a new image.
    """
    data = _rootfs_tar()
    name = name or f"{IMAGE_REPO}:{hashlib.sha256(data).hexdigest()[:12]}"
    with _image_lock:
        try:
            client.images.get(name)
            return name
        except docker.errors.ImageNotFound:
            pass
        repo, _, tag = name.partition(":")
        client.api.import_image_from_data(data, repository=repo, tag=tag or "latest")
        client.images.get(name)
        logger.info("imported sandbox image %s", name)
        return name


class DockerBackend:
    """Run harnesses in Docker containers on the engine that DOCKER_HOST (or the default socket) names."""

    name = "docker"

    def __init__(
        self,
        *,
        python: PythonEnv | None = None,
        inner_port: int = 8000,
        image: str | None = None,
        base_url: str | None = None,
        tmpfs_mb: int = 256,
    ) -> None:
        try:
            self.client = docker.DockerClient(base_url=base_url) if base_url else docker.from_env()
            self.client.ping()
        except docker.errors.DockerException as exc:
            raise SandboxError(f"no Docker engine answers ({exc}); start dockerd or set DOCKER_HOST") from exc
        self.python = python or PythonEnv.current()
        self._loader = self._filter_loader()
        self.inner_port = inner_port
        self.tmpfs_mb = tmpfs_mb
        try:
            self.image = ensure_image(self.client, image)
        except docker.errors.DockerException as exc:
            raise SandboxError(f"could not import the sandbox image: {exc}") from exc
        try:
            self.own_uids = maps_host_uids(list(self.client.info().get("SecurityOptions") or []))
        except docker.errors.DockerException as exc:
            raise SandboxError(f"docker info failed: {exc}") from exc
        if not self.own_uids:
            logger.warning(
                "this Docker engine is rootless or remaps user namespaces: its containers cannot take the "
                "clawpipe uid range, so every sandbox runs as uid %d and they share the kernel's per-uid budgets",
                SHARED_USER.uid,
            )
        self._ids = Path(tempfile.mkdtemp(prefix="clawpipe-docker-ids-"))
        self._ids.chmod(0o755)
        self._ids_lock = threading.Lock()

    def user(self, job: SandboxJob) -> SandboxUser:
        """Who the job's containers run as: its own uid, or 65534 on an engine that cannot (see __init__)."""
        return job.user if self.own_uids else SHARED_USER

    def _identity_dir(self, user: SandboxUser) -> Path:
        """A host folder holding passwd and group for ``user`` (written on the uid's first use)."""
        d = self._ids / str(user.uid)
        with self._ids_lock:
            if not d.is_dir():
                staging = Path(tempfile.mkdtemp(prefix=f"{user.uid}.", dir=self._ids))
                for name, text in zip(("passwd", "group"), identity_files(user), strict=True):
                    (staging / name).write_text(text)
                    (staging / name).chmod(0o644)
                staging.chmod(0o755)
                staging.rename(d)
        return d

    def _volumes(self, job: SandboxJob) -> dict[str, dict[str, str]]:
        vols: dict[str, dict[str, str]] = {"/usr": {"bind": "/usr", "mode": "ro"}}
        for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            host = Path("/") / top
            if host.is_dir() and not host.is_symlink():
                vols[str(host)] = {"bind": str(host), "mode": "ro"}
        for name in ETC_BINDS:
            if Path("/etc", name).exists():
                vols[f"/etc/{name}"] = {"bind": f"/etc/{name}", "mode": "ro"}
        for p in [*self.python.mounts(), *job.manifest.ro_paths]:
            vols[str(p)] = {"bind": str(p), "mode": "ro"}
        vols[str(job.manifest.dir)] = {"bind": INNER_HARNESS, "mode": "ro"}
        if job.manifest.kit_dir is not None:
            vols[str(job.manifest.kit_dir)] = {"bind": INNER_KIT, "mode": "ro"}
        vols[str(job.task_path)] = {"bind": INNER_TASK, "mode": "ro"}
        vols[str(job.workdir)] = {"bind": INNER_WORKDIR, "mode": "rw"}
        vols[str(self._env_path(job))] = {"bind": INNER_ENV, "mode": "ro"}
        ids = self._identity_dir(self.user(job))
        for name in ("passwd", "group"):
            vols[str(ids / name)] = {"bind": f"/etc/{name}", "mode": "ro"}
        return vols

    @staticmethod
    def _env_path(job: SandboxJob) -> Path:
        return job.rollout_dir / "harness.env"

    def _write_env(self, job: SandboxJob, env: dict[str, str]) -> None:
        """The harness's environment as sh assignments, readable by the sandbox user only (where we are root)."""
        path = self._env_path(job)
        text = "".join(f"{k}={shlex.quote(v)}\n" for k, v in env.items())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o400)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        if os.geteuid() == 0:
            os.chown(path, self.user(job).uid, self.user(job).gid)
        else:  # docker-group user: the container's uid must still read it
            os.chmod(path, 0o444)

    def _filter_loader(self) -> list[str]:
        """What runs the harness under the bwrap backend's seccomp filter, stacked on the engine's profile
        (nothing on a machine that filter is not built for: the engine's profile alone, with a warning)."""
        try:
            return loader_command(str(self.python.bin / "python3"))
        except SandboxError as exc:
            logger.warning("docker sandboxes get the engine's seccomp profile only: %s", exc)
            return []

    def _common(self, job: SandboxJob) -> dict[str, Any]:
        return {
            "user": f"{self.user(job).uid}:{self.user(job).gid}",
            "read_only": True,
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            # as in the other backends (clawpipe.sandbox.limits.apply_process_limits): not the engine's defaults
            "ulimits": [
                docker.types.Ulimit(name="nofile", soft=SANDBOX_NOFILE, hard=SANDBOX_NOFILE),
                docker.types.Ulimit(name="core", soft=0, hard=0),
            ],
            "labels": {LABEL: job.rollout_id},
        }

    def run(self, job: SandboxJob, bridge: Bridge) -> Outcome:
        t0 = time.monotonic()
        out = Outcome()
        suffix = job.unique_name("")
        holder = container = route = None
        try:
            try:
                # created, then started: the SDK's run() creates and starts in one call and, when the start
                # fails (the engine under load: "cannot start a stopped process"), raises without handing back
                # the container it created, which then outlives the rollout
                holder = self.client.containers.create(
                    self.image,
                    ["/usr/bin/sleep", "infinity"],
                    name=f"cp-hold{suffix}",
                    network_mode="none",
                    volumes={"/usr": {"bind": "/usr", "mode": "ro"}},
                    mem_limit="16m",
                    pids_limit=4,
                    **self._common(job),
                )
                holder.start()
                holder.reload()
                pid = int(holder.attrs["State"]["Pid"])
                if not pid:
                    raise SandboxError(f"holder container for {job.rollout_id} is not running")
                route = bridge.attach(listen_in_netns(pid, self.inner_port))
                env = harness_env(
                    job,
                    port=self.inner_port,
                    workdir=INNER_WORKDIR,
                    task_path=INNER_TASK,
                    path_dirs=[str(self.python.bin)],
                )
                mem = f"{job.limits.memory_mb}m"
                self._write_env(job, env)
                container = self.client.containers.create(
                    self.image,
                    [*ENV_LAUNCHER, *self._loader, *job.manifest.resolve_command(INNER_HARNESS)],
                    name=f"cp-run{suffix}",
                    network_mode=f"container:{holder.id}",
                    working_dir=INNER_WORKDIR,
                    volumes=self._volumes(job),
                    tmpfs={"/tmp": f"rw,nosuid,nodev,size={self.tmpfs_mb}m,mode=1777"},
                    mem_limit=mem,
                    memswap_limit=mem,
                    nano_cpus=int(job.limits.cpus * 1e9),
                    pids_limit=job.limits.pids,
                    stdin_open=False,
                    log_config=self._log_config(job),
                    **self._common(job),
                )
                container.start()
            except docker.errors.DockerException as exc:
                raise SandboxError(f"docker could not start the sandbox for {job.rollout_id}: {exc}") from exc
            out.setup_ms = (time.monotonic() - t0) * 1000
            status: dict[str, Any] | None = None
            try:
                status = container.wait(timeout=job.timeout_s)
            except (requests.exceptions.ConnectionError, requests.exceptions.ReadTimeout):
                out.timed_out = True  # the SDK reports its wait timeout as a connection error
            if out.timed_out:
                try:
                    container.kill()
                except docker.errors.APIError:
                    pass
                status = container.wait(timeout=30)
            container.reload()
            state = container.attrs["State"]
            out.oom = bool(state.get("OOMKilled"))
            code = int((status or {}).get("StatusCode", state.get("ExitCode", -1)))
            if not out.timed_out:
                out.exit_code, out.signal = decode_shell_status(code)
            self._save_logs(container, job)
            return out
        finally:
            with contextlib.suppress(OSError):
                self._env_path(job).unlink()
            if route is not None:
                detach_route(bridge, route, out)
            for c in (container, holder):
                if c is not None:
                    try:
                        c.remove(force=True)
                    except docker.errors.DockerException as exc:
                        logger.warning("could not remove container %s: %s", c.name, exc)

    @staticmethod
    def _log_config(job: SandboxJob) -> dict[str, Any]:
        """The engine keeps the harness's output on the host's disk and the runner copies it into the rollout's
        folder: both bounded, by one log file of at most LOG_MAX_MB that starts over when full."""
        size = max(1, min(LOG_MAX_MB, job.limits.disk_mb // 4))
        return {"type": "json-file", "config": {"max-size": f"{size}m", "max-file": "1"}}

    @staticmethod
    def _save_logs(container: Any, job: SandboxJob) -> None:
        """Copy the container's stderr, then its stdout, into the rollout's folder, streamed; where the folder's
        quota runs out the copy stops there (the rollout then ends disk_quota), never with an error."""
        for path, stdout in ((job.stderr_path, False), (job.stdout_path, True)):
            try:
                with open(path, "wb") as f:
                    for chunk in container.logs(stdout=stdout, stderr=not stdout, stream=True, follow=False):
                        f.write(chunk)
            except OSError as exc:
                logger.info("log copy to %s stopped: %s", path.name, exc)
            except docker.errors.DockerException as exc:
                with contextlib.suppress(OSError):
                    path.write_text(f"(logs unavailable: {exc})")

    def cleanup(self) -> int:
        """Remove any clawpipe containers left behind (e.g. by a killed runner); returns how many."""
        n = 0
        for c in self.client.containers.list(all=True, filters={"label": LABEL}):
            c.remove(force=True)
            n += 1
        return n

    def close(self) -> None:
        self.client.close()
        shutil.rmtree(self._ids, ignore_errors=True)
