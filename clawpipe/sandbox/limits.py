"""Resource limits for one sandbox: a cgroup (v1 or v2, detected) or, where none is writable, rlimits.

A :class:`Cgroup` is created as a child of the runner's own cgroup (so limits set above clawpipe still
apply), gets memory / CPU / pids limits, receives the sandbox's first process before that process runs
the harness, and afterwards tells whether the kernel OOM-killed anything in it. :func:`detect_cgroups`
reads /proc/self/mountinfo once; a controller that is missing or not writable is left out and the
rlimit fallback (:func:`apply_rlimits`) covers it.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import resource
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from clawpipe.errors import ConfigError

logger = logging.getLogger(__name__)

CONTROLLERS = ("memory", "cpu", "pids")
CFS_PERIOD_US = 100_000
NPROC_SHARE = 16  # rlimit fallback: RLIMIT_NPROC is per uid, shared by sandboxes on the shared uid 65534
FDS_PER_SANDBOX = 16  # the runner's own descriptors per sandbox: pipes, logs, pidfd, listener, cgroup files
FDS_RESERVED = 256  # the runner itself: result files, the proxy check, imports, logging
MIN_CONNECTIONS = 4
# Open files per sandbox process, soft and hard. Without it a harness inherited the runner's own limit (raised
# for the bridge's connections, up to its hard limit): a few processes at a million descriptors each fill
# the host's file table (fs.file-max), and every other process on the host then gets ENFILE. Room enough for
# a program holding one descriptor per level of a 10,000-deep folder tree.
SANDBOX_NOFILE = 16384


@dataclass(frozen=True, slots=True)
class Limits:
    """What one sandbox may use."""

    memory_mb: int = 1024
    cpus: float = 1.0
    pids: int = 128
    disk_mb: int = 1024  # work dir, task and logs (a tmpfs per rollout; see clawpipe.sandbox.quota)


@dataclass(frozen=True, slots=True)
class CgroupLayout:
    """Where each controller's parent directory is (the runner's own cgroup), and the hierarchy version."""

    version: int  # 1 or 2; 0 when no controller is usable
    parents: dict[str, Path] = field(default_factory=dict)  # controller -> directory children are made in

    @property
    def usable(self) -> bool:
        return bool(self.parents)


def _own_cgroup_paths() -> dict[str, str]:
    paths: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(",") if ctrls else [""]:
            paths[c] = path
    return paths


def _writable_dir(path: Path) -> bool:
    probe = path / f"clawpipe-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except OSError:
        return False
    _rmdir_retry(probe)
    return True


@functools.lru_cache(maxsize=1)
def detect_cgroups() -> CgroupLayout:
    """Find writable memory/cpu/pids controllers: v1 per-controller mounts first, else the v2 unified tree."""
    own = _own_cgroup_paths()
    v1: dict[str, Path] = {}
    v2_root: Path | None = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(rfields) < 3:
            continue
        mount_point, fstype, opts = fields[4], rfields[0], rfields[2].split(",")
        if fstype == "cgroup":
            for c in CONTROLLERS:
                if c in opts:
                    v1[c] = Path(mount_point) / own.get(c, "/").lstrip("/")
        elif fstype == "cgroup2" and v2_root is None:
            v2_root = Path(mount_point) / own.get("", "/").lstrip("/")
    parents = {c: p for c, p in v1.items() if p.is_dir() and _writable_dir(p)}
    if parents:
        return CgroupLayout(version=1, parents=parents)
    if v2_root is not None and (v2_root / "cgroup.controllers").exists():
        available = set((v2_root / "cgroup.controllers").read_text().split())
        wanted = [c for c in CONTROLLERS if c in available]
        try:
            # Children get the controllers only if the parent delegates them.
            (v2_root / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in wanted))
        except OSError as exc:
            logger.debug("cgroup v2 subtree_control not writable: %s", exc)
        enabled = set((v2_root / "cgroup.subtree_control").read_text().split())
        if enabled and _writable_dir(v2_root):
            return CgroupLayout(version=2, parents={c: v2_root for c in wanted if c in enabled})
    return CgroupLayout(version=0)


def _rmdir_retry(path: Path, attempts: int = 50) -> None:
    for i in range(attempts):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or i == attempts - 1:
                logger.warning("could not remove cgroup %s: %s", path, exc)
                return
            time.sleep(0.02)


class Cgroup:
    """One sandbox's cgroup across the usable controllers. Use as a context manager; removal retries EBUSY."""

    def __init__(self, name: str, limits: Limits, layout: CgroupLayout | None = None) -> None:
        self.layout = layout or detect_cgroups()
        self.limits = limits
        self.dirs: dict[str, Path] = {}
        for c, parent in self.layout.parents.items():
            d = parent / name
            if d not in self.dirs.values():
                d.mkdir(exist_ok=True)
            self.dirs[c] = d
        self._write_limits()

    @property
    def controllers(self) -> set[str]:
        return set(self.dirs)

    def _write_limits(self) -> None:
        mem = self.limits.memory_mb * 1024 * 1024
        quota = max(1000, int(self.limits.cpus * CFS_PERIOD_US))
        if self.layout.version == 1:
            writes = {
                "memory": [("memory.limit_in_bytes", str(mem))],
                "cpu": [("cpu.cfs_period_us", str(CFS_PERIOD_US)), ("cpu.cfs_quota_us", str(quota))],
                "pids": [("pids.max", str(self.limits.pids))],
            }
        else:
            writes = {
                "memory": [("memory.max", str(mem)), ("memory.swap.max", "0")],
                "cpu": [("cpu.max", f"{quota} {CFS_PERIOD_US}")],
                "pids": [("pids.max", str(self.limits.pids))],
            }
        for c, d in self.dirs.items():
            for fname, value in writes[c]:
                try:
                    (d / fname).write_text(value)
                except OSError as exc:
                    if fname == "memory.swap.max":  # absent without swap accounting
                        continue
                    raise OSError(f"cannot write {d / fname}: {exc}") from exc

    def add(self, pid: int) -> None:
        """Move a process (before it starts the harness) into every controller's group."""
        for d in set(self.dirs.values()):
            (d / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        seen: set[int] = set()
        for d in set(self.dirs.values()):
            try:
                seen.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return sorted(seen)

    def kill_all(self) -> None:
        """SIGKILL everything still in the group (daemonised descendants included)."""
        d = self.dirs.get("pids") or self.dirs.get("memory")
        if self.layout.version == 2 and d is not None and (d / "cgroup.kill").exists():
            try:
                (d / "cgroup.kill").write_text("1")
            except OSError:
                pass
        for _ in range(20):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer fired inside this group."""
        d = self.dirs.get("memory")
        if d is None:
            return False
        try:
            if self.layout.version == 1:
                text = (d / "memory.oom_control").read_text()
                return any(line.split()[0] == "oom_kill" and int(line.split()[1]) > 0 for line in text.splitlines())
            text = (d / "memory.events").read_text()
            return any(line.split()[0] == "oom_kill" and int(line.split()[1]) > 0 for line in text.splitlines())
        except (OSError, ValueError, IndexError):
            return False

    def pids_limited(self) -> bool:
        """Whether a fork was refused because of the pids limit."""
        d = self.dirs.get("pids")
        if d is None:
            return False
        try:
            text = (d / "pids.events").read_text()
            return any(line.split()[0] == "max" and int(line.split()[1]) > 0 for line in text.splitlines())
        except (OSError, ValueError, IndexError):
            return False

    def remove(self) -> None:
        self.kill_all()
        for d in set(self.dirs.values()):
            _rmdir_retry(d)

    def __enter__(self) -> Cgroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def sweep_stale_cgroups(layout: CgroupLayout | None = None, min_age_s: float = 60.0) -> int:
    """Remove empty ``clawpipe-*`` groups left by a runner that was killed; returns how many.

    Only groups older than ``min_age_s`` go, so a concurrent runner's group (filled within milliseconds of
    its creation) is never touched.
    """
    layout = layout or detect_cgroups()
    removed = 0
    now = time.time()
    for parent in set(layout.parents.values()):
        for d in parent.glob("clawpipe-*"):
            try:
                if now - d.stat().st_mtime < min_age_s or (d / "cgroup.procs").read_text().strip():
                    continue
                d.rmdir()
                removed += 1
            except OSError:
                continue
    return removed


def apply_rlimits(pid: int, limits: Limits, missing: set[str], timeout_s: float, *, shared_uid: bool = True) -> None:
    """Fallback for controllers that no cgroup covers: per-process rlimits, inherited by children.

    Memory becomes RLIMIT_AS (address space, stricter than RSS; Python then raises MemoryError, which the
    runner reports as oom). pids becomes RLIMIT_NPROC, which the kernel counts per uid: with a uid of the
    sandbox's own (clawpipe.sandbox.uids) that is exactly ``pids``; with the ``shared_uid`` of every sandbox
    it is NPROC_SHARE x pids, a fork bomb still bounded, but more loosely than by a pids cgroup. CPUs
    becomes a CPU-seconds cap of cpus x timeout.
    """
    if "memory" in missing:
        mem = limits.memory_mb * 1024 * 1024
        resource.prlimit(pid, resource.RLIMIT_AS, (mem, mem))
    if "pids" in missing:
        nproc = limits.pids * (NPROC_SHARE if shared_uid else 1)
        resource.prlimit(pid, resource.RLIMIT_NPROC, (nproc, nproc))
    if "cpu" in missing:
        secs = max(1, int(limits.cpus * timeout_s) + 1)
        resource.prlimit(pid, resource.RLIMIT_CPU, (secs, secs + 1))


def apply_file_size_limit(pid: int, limits: Limits) -> None:
    """No single file may outgrow the disk quota (the kernel's own check; the only one where no per-rollout
    tmpfs can be mounted)."""
    size = limits.disk_mb << 20
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (size, size))


def apply_process_limits(pid: int) -> None:
    """What every sandbox gets whatever its cgroup: SANDBOX_NOFILE open files per process, and no core dumps
    (hard limits, so the harness cannot raise them). A core file would land in the work dir the host reads
    back; where the host's kernel.core_pattern pipes cores to a helper, that helper runs as root on the host
    and writes outside the rollout's quota (systemd-coredump and apport store nothing at a limit of 0)."""
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (SANDBOX_NOFILE, SANDBOX_NOFILE))
    resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))


def connection_cap(concurrency: int, wanted: int, nofile: int) -> int:
    """Each sandbox's bridge connection cap, so that ``concurrency`` sandboxes at their caps fit in ``nofile``
    descriptors (every bridged connection costs the runner two: the sandbox's side and the proxy's).

    Returns ``wanted`` when it fits, else the largest equal share; raises ConfigError when not even
    MIN_CONNECTIONS fit.
    """
    share = (nofile - FDS_RESERVED) // max(1, concurrency) - FDS_PER_SANDBOX
    cap = min(wanted, share // 2)
    if cap < MIN_CONNECTIONS:
        raise ConfigError(
            f"{concurrency} sandboxes do not fit in {nofile} file descriptors (each needs {FDS_PER_SANDBOX} plus 2 "
            f"per bridge connection, at least {MIN_CONNECTIONS}); lower the concurrency or raise `ulimit -n`"
        )
    return cap


def sandbox_connection_cap(concurrency: int, wanted: int) -> int:
    """:func:`connection_cap` for this process, after raising its soft RLIMIT_NOFILE as far as needed and allowed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = FDS_RESERVED + concurrency * (FDS_PER_SANDBOX + 2 * wanted)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning("could not raise RLIMIT_NOFILE to %d: %s", target, exc)
    nofile = need if soft == resource.RLIM_INFINITY else soft
    cap = connection_cap(concurrency, wanted, nofile)
    if cap < wanted:
        logger.warning(
            "bridge connections per sandbox lowered from %d to %d to fit %d sandboxes in %d descriptors",
            wanted,
            cap,
            concurrency,
            nofile,
        )
    return cap
