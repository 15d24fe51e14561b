"""Per-rollout disk quota: each rollout's folder (work dir, task, logs) is its own size-limited tmpfs.

As root the runner mounts a tmpfs of ``disk_mb`` on the rollout folder before anything is written there;
a harness that writes past it gets ENOSPC in that folder alone, and the rollout's status becomes
``disk_quota`` (the folder was full when the harness ended). The tmpfs's pages are charged to the memory
cgroup of the process that writes them, so work-dir bytes also count toward the sandbox's memory limit,
and the host's disks are never touched. Unmounting frees everything at once, at any depth.

Each mount's source names the runner that made it (``clawpipe-rollout-<pid>``): a runner killed with
SIGKILL cannot unmount its rollouts' folders, so every runner first sweeps away the mounts of runners
that are gone (:func:`sweep_stale_mounts`).

Where mounting is not allowed (not root, or a container without CAP_SYS_ADMIN) the fallback is weaker
but still enforced by the kernel per file: RLIMIT_FSIZE of ``disk_mb`` (a bigger file gets EFBIG or
SIGXFSZ), and the folder's total is measured after the run; over the quota is ``disk_quota`` too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import re
import signal
from pathlib import Path

from clawpipe.procs import pid_alive
from clawpipe.sandbox.fstree import copy_tree, remove_tree, walk

logger = logging.getLogger(__name__)

MS_NOSUID, MS_NODEV = 0x2, 0x4
MNT_DETACH = 0x2
MOUNT_SOURCE = "clawpipe-rollout"
FULL_SLACK_BYTES = 256 * 1024  # less than this left on the tmpfs when the harness ended: it ran out
FULL_SLACK_INODES = 8
INODES_PER_MB = 256  # a tmpfs's default inode count follows the host's RAM, not its size
MIN_INODES = 4096
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_warned = False


def quota_inodes(disk_mb: int) -> int:
    """How many files and folders a rollout folder of ``disk_mb`` may hold.

    Empty files take no blocks, so without this cap a few MB of quota held millions of them, each one
    walked by the host when it scrubs the work dir (and copied to disk for kept work dirs).
    """
    return max(MIN_INODES, disk_mb * INODES_PER_MB)


def mount_quota(folder: Path, disk_mb: int) -> bool:
    """Mount a ``disk_mb`` tmpfs holding at most :func:`quota_inodes` entries on the (existing, empty)
    ``folder``; False where mounting is not allowed."""
    global _warned
    opts = f"size={disk_mb}m,nr_inodes={quota_inodes(disk_mb)},mode=0755".encode()
    source = f"{MOUNT_SOURCE}-{os.getpid()}".encode()
    if _libc.mount(source, os.fsencode(folder), b"tmpfs", MS_NOSUID | MS_NODEV, opts) == 0:
        return True
    err = ctypes.get_errno()
    if err not in (errno.EPERM, errno.EACCES):
        raise OSError(err, f"mount tmpfs on {folder}: {os.strerror(err)}")
    if not _warned:
        _warned = True
        logger.warning(
            "cannot mount a tmpfs per rollout (%s): disk quotas fall back to a per-file size limit and a "
            "size check after each run; run as root for a hard quota",
            os.strerror(err),
        )
    return False


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes are written as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def stale_mounts(mountinfo: str) -> list[str]:
    """Mount points of rollout tmpfs mounts whose runner (the pid in the mount's source) is gone."""
    out = []
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 2 or rest[0] != "tmpfs":
            continue
        owner = rest[1].removeprefix(f"{MOUNT_SOURCE}-")
        if owner != rest[1] and owner.isdigit() and not pid_alive(int(owner)):
            out.append(_unescape(fields[4]))
    return out


def sweep_stale_mounts() -> int:
    """Unmount (lazily) the rollout folders of runners that were killed before they could; returns how many."""
    try:
        with open("/proc/self/mountinfo") as f:
            points = stale_mounts(f.read())
    except OSError:
        return 0
    swept = 0
    for point in sorted(points, key=len, reverse=True):  # inner mounts first
        if _libc.umount2(os.fsencode(point), MNT_DETACH) == 0:
            swept += 1
        else:
            logger.warning("cannot unmount a stale rollout folder %s: %s", point, os.strerror(ctypes.get_errno()))
    if swept:
        logger.info("unmounted %d rollout folders left by runners that were killed", swept)
    return swept


def unmount_quota(folder: Path) -> None:
    """Unmount the rollout folder's tmpfs if it has one (lazily: a process still inside keeps it alive)."""
    while os.path.ismount(folder):  # a loop: a killed runner's rerun may find one mounted over another
        if _libc.umount2(os.fsencode(folder), MNT_DETACH) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"umount {folder}: {os.strerror(err)}")


def used_bytes(folder: Path) -> int:
    """Bytes allocated under ``folder``: the tmpfs's own count, or a walk where there is none."""
    if os.path.ismount(folder):
        st = os.statvfs(folder)
        return (st.f_blocks - st.f_bfree) * st.f_frsize
    return sum(e.st.st_blocks * 512 for e in walk(folder))


def over_quota(folder: Path, disk_mb: int, killed_by: int | None = None) -> bool:
    """Whether the rollout ran out of its quota: its tmpfs is (nearly) full of bytes or of files, or,
    without one, the folder holds more than ``disk_mb`` or the harness was killed for a file over
    RLIMIT_FSIZE."""
    if killed_by == signal.SIGXFSZ:
        return True
    if os.path.ismount(folder):
        return out_of_space(folder) or out_of_inodes(folder)
    return used_bytes(folder) > disk_mb << 20


def out_of_space(folder: Path) -> bool:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize < FULL_SLACK_BYTES


def out_of_inodes(folder: Path) -> bool:
    """Whether the rollout folder's tmpfs has (nearly) no file left to create."""
    return os.path.ismount(folder) and os.statvfs(folder).f_favail < FULL_SLACK_INODES


def release(folder: Path, keep: bool = False) -> None:
    """Free a rollout folder: unmount its tmpfs and remove it; with ``keep``, its contents stay at the same
    path on disk (copied out of the tmpfs first, hard links kept as links, files past the bytes the tmpfs
    held left out)."""
    if not os.path.ismount(folder):
        if not keep:
            remove_tree(folder)
        return
    if keep:
        staging = folder.with_name(f".{folder.name}.keep")
        remove_tree(staging)
        # No more than the tmpfs held: hard links and holes would otherwise multiply on the host's disk.
        left_out = copy_tree(folder, staging, max_bytes=used_bytes(folder))
        if left_out:
            logger.warning(
                "kept %s without %d files past the %d bytes its tmpfs held", folder, left_out, used_bytes(folder)
            )
        unmount_quota(folder)
        os.rmdir(folder)
        os.rename(staging, folder)
        return
    unmount_quota(folder)
    remove_tree(folder)
