"""A host uid (and gid of the same number) per running sandbox, from a range reserved for clawpipe.

The kernel keeps several budgets per uid across the whole host: inotify instances and watches, POSIX
message queue bytes, pending signals, RLIMIT_NPROC's process count. Sandboxes sharing one uid share them,
so one rollout could exhaust what its concurrent neighbours need. Each sandbox therefore runs as its own
uid from ``[base, base + count)`` (CLAWPIPE_SANDBOX_UID_BASE, CLAWPIPE_SANDBOX_UID_COUNT), whose gid is
the same number.

Allocation works across every runner process on the host: a uid is taken by an exclusive ``flock`` on
``<lock dir>/<uid>.lock`` (root's own folder, mode 0700), held for the sandbox's lifetime and released
by the kernel when the holder dies, however it dies. While held, the lock file names the holder's pid; a
clean release empties it. A uid whose file is found non-empty was left by a runner that was killed, so
before it is handed out again every process still running under it (e.g. a container of that runner) is
killed; on a clean release the same sweep runs first, so a uid is never reused while a process of its
previous sandbox lives. The sweep is a ``kill(-1, SIGKILL)`` from a helper running as the uid (the kernel's
one pass over every process, which no fork escapes), then scans of /proc until nothing of the uid runs.
The range must stay clear of host users and groups and of the subordinate ids (/etc/subuid, /etc/subgid)
that users' rootless containers run as: the sweep would kill those.

Where no lock folder can be used (or the backend cannot take such uids: a rootless Docker engine),
sandboxes fall back to the shared uid 65534 (``nobody``), with a warning: the per-uid budgets are then
shared again. A job built without a lease (``SandboxJob.user``'s default) runs as 65534 too.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from clawpipe.errors import ConfigError, SandboxError
from clawpipe.sandbox.sweep import kill_processes_of, processes_of

logger = logging.getLogger(__name__)

SHARED_UID = 65534  # nobody: the fallback where no uid of the range can be taken
SHARED_GID = 65534
DEFAULT_BASE = 1_100_000  # far above real users (useradd stops at 60000) and 65534
DEFAULT_COUNT = 4096
MAX_ID = 2**32 - 2  # (uid_t)-1 means "no change" to setresuid and friends
ROOT_LOCK_DIR = Path("/run/clawpipe/sandbox-uids")
SUBID_FILES = ("/etc/subuid", "/etc/subgid")
LEASE_WAIT_S = 60.0  # every uid in use (other runners on the host): wait this long for one before failing


@dataclass(frozen=True, slots=True)
class SandboxUser:
    """Who a sandbox's processes run as on the host."""

    uid: int
    gid: int

    @property
    def shared(self) -> bool:
        return self.uid == SHARED_UID


SHARED_USER = SandboxUser(SHARED_UID, SHARED_GID)


def _ids_in(path: str, column: int) -> set[int]:
    ids: set[int] = set()
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split(":")
                if len(fields) > column and fields[column].strip().isdigit():
                    ids.add(int(fields[column]))
    except OSError:
        pass
    return ids


def _subordinate_overlap(base: int, count: int) -> str | None:
    """The first subordinate id range (/etc/subuid, /etc/subgid: ``owner:first:count``) that meets
    ``[base, base + count)``, as ``file (owner first-last)``; None when none does."""
    for path in SUBID_FILES:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                rows = [line.strip().split(":") for line in f]
        except OSError:
            continue
        for row in rows:
            if len(row) == 3 and row[1].isdigit() and row[2].isdigit():
                first, n = int(row[1]), int(row[2])
                if first < base + count and base < first + n:
                    return f"{path} ({row[0]} {first}-{first + n - 1})"
    return None


def validate_range(base: int, count: int, concurrency: int = 1) -> None:
    """Raise ConfigError unless ``[base, base + count)`` is a usable sandbox uid range for ``concurrency``
    sandboxes at once: inside [1, 2^32 - 2], clear of every uid in /etc/passwd and gid in /etc/group, and of
    the subordinate ids users' rootless containers run as (/etc/subuid, /etc/subgid)."""
    where = "(CLAWPIPE_SANDBOX_UID_BASE / CLAWPIPE_SANDBOX_UID_COUNT)"
    if count < 1 or base < 1 or base + count - 1 > MAX_ID:
        raise ConfigError(
            f"sandbox uid range [{base}, {base + count - 1}] {where} must lie within [1, {MAX_ID}] and hold at "
            f"least one uid; the default is {DEFAULT_BASE} + {DEFAULT_COUNT}"
        )
    taken = sorted(i for i in _ids_in("/etc/passwd", 2) | _ids_in("/etc/group", 2) if base <= i < base + count)
    if taken:
        raise ConfigError(
            f"sandbox uid range [{base}, {base + count - 1}] {where} overlaps host users or groups "
            f"({', '.join(map(str, taken[:5]))}): a sandbox would act as them; move the range above them"
        )
    sub = _subordinate_overlap(base, count)
    if sub:  # the sweep before each reuse would kill that user's container processes, and sandboxes act as them
        raise ConfigError(
            f"sandbox uid range [{base}, {base + count - 1}] {where} overlaps the subordinate ids of {sub}, which "
            "a user's rootless containers run as; move the range clear of every range there"
        )
    if count < concurrency:
        raise ConfigError(
            f"sandbox uid range {where} holds {count} uids, fewer than the {concurrency} sandboxes to run at once; "
            f"raise CLAWPIPE_SANDBOX_UID_COUNT to at least {concurrency}"
        )


def _mapped(path: str) -> list[tuple[int, int]] | None:
    """The id ranges ``[first, end)`` this process's user namespace maps (None when the file is unreadable)."""
    try:
        with open(path) as f:
            rows = [line.split() for line in f]
    except OSError:
        return None
    return [(int(r[0]), int(r[0]) + int(r[2])) for r in rows if len(r) == 3 and all(x.isdigit() for x in r)]


def unmapped_ids(base: int, count: int) -> str | None:
    """The first uid or gid of ``[base, base + count)`` that this user namespace cannot switch to, or None.

    In a container whose id map is narrow (often 0-65535), setuid to an unmapped id fails with EINVAL: every
    sandbox would fail to start."""
    for kind, path in (("uid", "/proc/self/uid_map"), ("gid", "/proc/self/gid_map")):
        ranges = _mapped(path)
        if ranges is None:
            continue
        covered, at = True, base
        while at < base + count and covered:
            hit = next((end for first, end in ranges if first <= at < end), None)
            covered = hit is not None
            at = hit if hit is not None else at
        if not covered:
            return f"{kind} {at}"
    return None


class UidLease:
    """One uid of the range, held until :meth:`release` (or the holder's death)."""

    def __init__(self, user: SandboxUser, fd: int | None) -> None:
        self.user = user
        self._fd = fd

    def release(self) -> None:
        """Kill whatever still runs as this uid, mark the uid clean, and let it go. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            kill_processes_of(self.user.uid)
            os.ftruncate(fd, 0)  # clean: the next holder need not sweep
        except (SandboxError, OSError) as exc:  # left marked: the next holder sweeps again before use
            logger.warning("sandbox uid %d released without a clean sweep: %s", self.user.uid, exc)
        finally:
            os.close(fd)  # drops the flock


class UidPool:
    """The host's sandbox uids ``[base, base + count)``, shared with other runners through ``lock_dir``."""

    def __init__(self, base: int = DEFAULT_BASE, count: int = DEFAULT_COUNT, lock_dir: Path | None = None) -> None:
        validate_range(base, count)
        self.base = base
        self.count = count
        self.lock_dir = lock_dir if lock_dir is not None else default_lock_dir()
        self._ready = False
        self._warned = False
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls) -> UidPool:
        from clawpipe.config import get_settings

        s = get_settings()
        return cls(s.sandbox_uid_base, s.sandbox_uid_count, s.sandbox_uid_locks)

    def check(self, concurrency: int) -> None:
        """ConfigError when the range cannot hold ``concurrency`` sandboxes at once."""
        validate_range(self.base, self.count, concurrency)

    def _prepare(self) -> bool:
        """Create (or check) the lock folder: ours, a real folder, writable by nobody else."""
        with self._lock:
            if self._ready:
                return True
            try:
                unmapped = unmapped_ids(self.base, self.count)
                if unmapped:
                    raise OSError(
                        errno.EINVAL,
                        f"{unmapped} in [{self.base}, {self.base + self.count - 1}] has no mapping in this user "
                        "namespace (/proc/self/uid_map, gid_map; a container with a narrow id map): move the range "
                        "inside the mapped ids with CLAWPIPE_SANDBOX_UID_BASE",
                    )
                try:
                    self.lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                except OSError as exc:  # e.g. a container whose /run is read-only
                    raise OSError(
                        exc.errno,
                        f"cannot make {self.lock_dir} ({exc.strerror}): point CLAWPIPE_SANDBOX_UID_LOCKS at a folder "
                        f"on a writable disk that only uid {os.geteuid()} may write",
                    ) from exc
                st = os.lstat(self.lock_dir)
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                    raise OSError(
                        errno.EPERM,
                        f"{self.lock_dir} must be a folder owned by uid {os.geteuid()} that no one else may write "
                        f"(chown {os.geteuid()} {self.lock_dir}; chmod 700 {self.lock_dir})",
                    )
            except OSError as exc:
                if not self._warned:
                    self._warned = True
                    logger.warning(
                        "no sandbox uid lock folder (%s): every sandbox runs as the shared uid %d, so they share "
                        "the kernel's per-uid budgets (inotify, message queues, processes)",
                        exc,
                        SHARED_UID,
                    )
                return False
            self._ready = True
            return True

    def lease(self, wait_s: float = LEASE_WAIT_S) -> UidLease:
        """Take a free uid of the range (the lowest one free); waits up to ``wait_s`` while all are in use.
        Raises SandboxError when none comes free (an infra error: the rollout is retried)."""
        if not self._prepare():
            return UidLease(SHARED_USER, None)
        deadline = time.monotonic() + wait_s
        while True:
            unusable: list[str] = []
            for uid in range(self.base, self.base + self.count):
                lease = self._try(uid, unusable)
                if lease is not None:
                    return lease
            if time.monotonic() >= deadline:
                why = f"; {len(unusable)} could not be locked, e.g. {unusable[0]}" if unusable else ""
                raise SandboxError(
                    f"all {self.count} sandbox uids from {self.base} are in use on this host (lock folder "
                    f"{self.lock_dir}{why}); raise CLAWPIPE_SANDBOX_UID_COUNT or run fewer sandboxes at once"
                )
            time.sleep(0.05)

    @contextlib.contextmanager
    def leased(self) -> Iterator[SandboxUser]:
        lease = self.lease()
        try:
            yield lease.user
        finally:
            lease.release()

    def _try(self, uid: int, unusable: list[str]) -> UidLease | None:
        """A lease of ``uid`` if it is free; None when taken, or unusable (its reason added to ``unusable``)."""
        path = self.lock_dir / f"{uid}.lock"
        try:  # a link planted in place of a lock file is refused, and that uid skipped
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            unusable.append(f"{path}: {exc.strerror}")
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            previous = os.pread(fd, 64, 0)
            if previous:  # its last holder died holding it: whatever it left running goes first
                left = processes_of(uid)
                kill_processes_of(uid)
                logger.info(
                    "sandbox uid %d: killed what holder %s left running (pids %s)", uid, previous.decode().strip(), left
                )
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except (SandboxError, OSError) as exc:
            logger.warning("sandbox uid %d skipped: %s", uid, exc)
            unusable.append(f"uid {uid}: {exc}")
            os.close(fd)
            return None
        return UidLease(SandboxUser(uid, uid), fd)


def default_lock_dir() -> Path:
    """/run/clawpipe/sandbox-uids for root; a folder of one's own in the temporary folder otherwise."""
    if os.geteuid() == 0:
        return ROOT_LOCK_DIR
    return Path("/tmp") / f"clawpipe-sandbox-uids-{os.geteuid()}"


_default: UidPool | None = None
_default_lock = threading.Lock()


def default_pool() -> UidPool:
    """The pool the settings describe, made once per process."""
    global _default
    with _default_lock:
        if _default is None:
            _default = UidPool.from_settings()
        return _default
