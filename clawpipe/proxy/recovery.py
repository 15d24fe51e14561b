"""Segments a dead proxy left open: found by their free lock, their torn tail cut, sealed (at a writer's start).

A writer holds an exclusive ``flock`` on its open segment, so an ``.open`` segment whose lock is free belongs to
a writer that died (a crash, a kill, a full disk that stopped it mid-frame): what it wrote whole is kept, the
incomplete frame after the last intact one is cut (:func:`clawpipe.capture.recover_segment`), and the segment
is renamed to ``.seg`` for landing. A writer's new segment has a free lock for a moment after it is created,
so the writer checks, once it holds the lock, that its file was not sealed meanwhile (:func:`still_named`).
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from clawpipe import capture

log = logging.getLogger(__name__)


def recover_dead_segments(directory: Path) -> list[Path]:
    """Seal every ``.open`` segment in ``directory`` that no live writer holds; return the sealed paths."""
    sealed: list[Path] = []
    for path in sorted(directory.glob(f"*{capture.OPEN_SUFFIX}")):
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live writer owns it
            cut = capture.recover_segment(path)
            if cut:
                log.warning("cut torn tail segment=%s bytes=%d", path.name, cut)
            sealed.append(capture.seal_segment(path))
            fsync_dir(directory)
        finally:
            os.close(fd)
    return sealed


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def still_named(path: Path, fd: int) -> bool:
    """Whether ``path`` is still the file open at ``fd`` (not renamed or removed by a recovery)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_ino, st.st_dev) == (own.st_ino, own.st_dev)
