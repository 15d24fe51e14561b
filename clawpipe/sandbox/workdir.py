"""A rollout's folder on the host: scrubbing what a harness planted for the verifier, ownership and modes
for the sandbox user, the stderr tail, and the folder's release after its row is written."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

from clawpipe.sandbox.fstree import Entry, walk
from clawpipe.sandbox.quota import release

logger = logging.getLogger(__name__)

STDERR_TAIL_BYTES = 4000
SHOWN_SCRUBBED = 20  # removed paths named in reward_info; the rest are counted
SHOWN_PATH_CHARS = 1000


def scrub_workdir(workdir: Path) -> list[str]:
    """Remove what a harness may have planted for the host-side verifier: symlinks leaving the work dir,
    FIFOs, sockets and device nodes, at any depth. Returns the removed paths (relative)."""
    removed: list[str] = []
    root = workdir.resolve()
    for entry in walk(workdir):
        mode = entry.st.st_mode
        special = not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode))
        if special or (stat.S_ISLNK(mode) and link_leaves(entry, root)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.name, dir_fd=entry.dir_fd)
            removed.append(entry.relpath)
    return removed


def scrub_report(removed: list[str]) -> dict[str, object]:
    """What reward_info says of the scrubbed paths: the first SHOWN_SCRUBBED as UTF-8 text (:func:`shown_name`),
    each cut to SHOWN_PATH_CHARS (middle elided), and their number when that is more; a harness cannot bloat
    its result row with them."""
    half = SHOWN_PATH_CHARS // 2
    names = [shown_name(p) for p in removed[:SHOWN_SCRUBBED]]
    shown = [p if len(p) <= SHOWN_PATH_CHARS else f"{p[:half]}...{p[-half:]}" for p in names]
    report: dict[str, object] = {"scrubbed": shown}
    if len(removed) > SHOWN_SCRUBBED:
        report["scrubbed_count"] = len(removed)
    return report


def shown_name(path: str) -> str:
    """``path`` as text that is valid UTF-8: bytes of a file name that are not UTF-8 (which Python holds as
    lone surrogates, which no UTF-8 writer of the lake accepts) are written as ``\\xNN``."""
    try:
        raw = os.fsencode(path)
    except UnicodeEncodeError:  # a surrogate no file name decodes to (e.g. from a JSON "\\ud800" escape)
        raw = path.encode("utf-8", "surrogatepass")
    return raw.decode("utf-8", "backslashreplace")


def link_leaves(entry: Entry, root: Path) -> bool:
    """Whether a symlink in the work dir resolves outside it.

    The kernel resolves it, as the host's own open() of it would (O_PATH: nothing is opened, a FIFO does
    not block): resolving it component by component in Python took milliseconds for a target that steps
    through a link thousands of times, and the inode quota allows hundreds of thousands of such links. A
    link the kernel cannot resolve (dangling, a loop, more than 40 links deep, a path too long) is judged
    by its text: any absolute target or ".." component counts as leaving, since a link made only of
    downward steps cannot climb above its folder.
    """
    try:
        fd = os.open(entry.name, os.O_PATH | os.O_CLOEXEC, dir_fd=entry.dir_fd)
    except OSError:
        fd = -1
    if fd >= 0:
        try:
            target = Path(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            target = None
        finally:
            os.close(fd)
        if target is not None and target.is_absolute():
            return target != root and root not in target.parents
    text = os.readlink(entry.name, dir_fd=entry.dir_fd)
    return text.startswith("/") or ".." in text.split("/")


def chown_tree(path: Path, uid: int, gid: int) -> None:
    os.chown(path, uid, gid)
    for entry in walk(path):
        os.chown(entry.name, uid, gid, dir_fd=entry.dir_fd, follow_symlinks=False)


def ends_with_memory_error(stderr_tail: str) -> bool:
    lines = [line for line in stderr_tail.strip().splitlines() if line.strip()]
    return bool(lines) and lines[-1].startswith("MemoryError")


def open_tree(path: Path) -> None:
    path.chmod(0o777)
    for entry in walk(path):
        if stat.S_ISDIR(entry.st.st_mode):
            os.chmod(entry.name, 0o777, dir_fd=entry.dir_fd)
        elif stat.S_ISREG(entry.st.st_mode):
            os.chmod(entry.name, 0o666, dir_fd=entry.dir_fd)


def release_rollout_dir(rdir: Path, keep: bool) -> None:
    """Unmount and remove a rollout's folder (any depth), or with ``keep`` leave its contents on disk there; a
    failure is logged, never raised: the row is already written."""
    try:
        release(rdir, keep=keep)
    except OSError as exc:
        logger.warning("could not release rollout folder %s: %s", rdir, exc)


def tail(path: Path, n: int = STDERR_TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
