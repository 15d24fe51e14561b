"""Directory trees of any depth: walk, copy and remove without recursion and without long paths.

A work dir is written by untrusted code, so it may be 10,000 directories deep. Python's os.walk and
shutil.rmtree recurse (RecursionError past ~1,000 levels) and pass whole paths to the kernel
(ENAMETOOLONG past 4,096 bytes, which os.walk silently skips). Here every step is relative to an open
directory descriptor (``dir_fd``, O_NOFOLLOW), the stack is a list, and at most ``KEEP_FDS`` descriptors per
tree stay open: deeper ancestors are closed and reopened through ".." when the walk climbs back, checked
by device and inode so a swapped directory is an error, never a wrong turn. Symlinks are never followed.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

KEEP_FDS = 64
# O_DIRECTORY fails on anything else before it is opened, so a planted FIFO cannot block the walk.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_NOT_A_DIR = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)


@dataclass(slots=True)
class _Frame:
    """One directory on the walk's stack, open (or parked) in each tree walked in step."""

    name: str  # its name in the parent ("" for a root)
    fds: list[int]  # one per tree; -1 while parked
    ids: list[tuple[int, int]]  # (st_dev, st_ino) per tree, to check a reopen through ".."
    todo: list[str] = field(default_factory=list)  # entries still to visit (first tree)


def _open_dir(name: str, dir_fd: int | None = None) -> tuple[int, tuple[int, int]]:
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    st = os.fstat(fd)
    return fd, (st.st_dev, st.st_ino)


class _Stack:
    """The directories from the roots down to the current one, with a bounded number of open descriptors."""

    def __init__(self, roots: list[Path]) -> None:
        fds: list[int] = []
        ids: list[tuple[int, int]] = []
        try:
            for r in roots:
                fd, ident = _open_dir(str(r))
                fds.append(fd)
                ids.append(ident)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self.frames = [_Frame("", fds, ids, sorted(os.listdir(fds[0]), reverse=True))]

    @property
    def top(self) -> _Frame:
        return self.frames[-1]

    def push(self, name: str, fds: list[int], ids: list[tuple[int, int]]) -> None:
        self.frames.append(_Frame(name, fds, ids, sorted(os.listdir(fds[0]), reverse=True)))
        if len(self.frames) > KEEP_FDS:
            parked = self.frames[-KEEP_FDS - 1]
            for fd in parked.fds:
                if fd >= 0:
                    os.close(fd)
            parked.fds = [-1] * len(parked.fds)

    def pop(self) -> _Frame:
        """Leave the current directory (its descriptors closed) and make sure its parent is open again."""
        child = self.frames.pop()
        try:
            parent = self.frames[-1] if self.frames else None
            if parent is not None and parent.fds[0] < 0:
                fds = []
                for fd, want in zip(child.fds, parent.ids, strict=True):
                    up, got = _open_dir("..", fd)
                    fds.append(up)
                    if got != want:
                        for f in fds:
                            os.close(f)
                        raise OSError(errno.ESTALE, "a directory was moved while it was walked")
                parent.fds = fds
        finally:
            for fd in child.fds:
                os.close(fd)
        return child

    def close(self) -> None:
        while self.frames:
            frame = self.frames.pop()
            for fd in frame.fds:
                if fd >= 0:
                    os.close(fd)


@dataclass(slots=True)
class Entry:
    """One entry met by a walk: act on it through ``dir_fd`` and ``name`` (never a path). ``relpath`` and
    ``depth`` are valid until the walk moves on."""

    dir_fd: int
    name: str
    st: os.stat_result
    _frames: list[_Frame]
    _level: int

    @property
    def relpath(self) -> str:
        return "/".join([*(f.name for f in self._frames[1 : self._level]), self.name])

    @property
    def depth(self) -> int:
        return self._level


def walk(root: Path) -> Iterator[Entry]:
    """Every entry under ``root``, parents before children, symlinks not followed.

    The consumer may remove or change the entry it was given before asking for the next; a directory it
    replaced is not entered. Entries that vanish meanwhile are skipped.
    """
    stack = _Stack([root])
    try:
        while stack.frames:
            frame = stack.top
            if not frame.todo:
                stack.pop()
                continue
            name = frame.todo.pop()
            try:
                st = os.stat(name, dir_fd=frame.fds[0], follow_symlinks=False)
            except FileNotFoundError:
                continue
            yield Entry(frame.fds[0], name, st, stack.frames, len(stack.frames))
            if stat.S_ISDIR(st.st_mode):
                try:
                    fd, ident = _open_dir(name, frame.fds[0])
                except OSError as exc:
                    if exc.errno not in _NOT_A_DIR:
                        raise
                    continue
                stack.push(name, [fd], [ident])
    finally:
        stack.close()


def remove_tree(root: Path, *, missing_ok: bool = True) -> None:
    """Remove ``root`` and everything under it, at any depth. Raises the first OSError it could not get past."""
    try:
        stack = _Stack([root])
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    except NotADirectoryError:
        root.unlink()
        return
    try:
        while stack.frames:
            frame = stack.top
            if not frame.todo:
                done = stack.pop()
                if stack.frames:
                    os.rmdir(done.name, dir_fd=stack.top.fds[0])
                continue
            name = frame.todo.pop()
            try:
                fd, ident = _open_dir(name, frame.fds[0])
            except OSError as exc:
                if exc.errno not in _NOT_A_DIR:
                    raise
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=frame.fds[0])
                continue
            stack.push(name, [fd], [ident])
    finally:
        stack.close()
    os.rmdir(root)


def copy_tree(
    src: Path, dst: Path, *, keep: Callable[[Entry], bool] | None = None, max_bytes: int | None = None
) -> int:
    """Copy ``src`` into a new folder ``dst``: directories, regular files (mode kept) and symlinks (as links),
    with their owners when run as root.

    Other kinds (FIFOs, sockets, devices) are left out, and so is any entry ``keep`` rejects. Any depth.
    A file's further names stay hard links to its one copy, and regular files are copied only while their
    sizes total at most ``max_bytes``: links and holes fill no quota, so a plain copy of a full tree could
    take any multiple of it. Returns how many files were left out for the budget.
    """
    owners = os.geteuid() == 0
    os.mkdir(dst, 0o700)
    budget = max_bytes
    left_out = 0
    copies: dict[tuple[int, int], str] = {}  # (st_dev, st_ino) of a multiply linked source -> its copy's path
    stack = _Stack([src, dst])
    root_fd = os.open(dst, _DIR_FLAGS)
    try:
        while stack.frames:
            frame = stack.top
            if not frame.todo:
                stack.pop()
                continue
            name = frame.todo.pop()
            s_fd, d_fd = frame.fds
            try:
                st = os.stat(name, dir_fd=s_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if keep is not None and not keep(Entry(s_fd, name, st, stack.frames, len(stack.frames))):
                continue
            if stat.S_ISDIR(st.st_mode):
                os.mkdir(name, 0o700, dir_fd=d_fd)
                fd_s, id_s = _open_dir(name, s_fd)
                try:
                    fd_d, id_d = _open_dir(name, d_fd)
                except BaseException:
                    os.close(fd_s)
                    raise
                os.chmod(fd_d, stat.S_IMODE(st.st_mode) | 0o700)
                stack.push(name, [fd_s, fd_d], [id_s, id_d])
            elif stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(name, dir_fd=s_fd), name, dir_fd=d_fd)
            elif stat.S_ISREG(st.st_mode):
                ident = (st.st_dev, st.st_ino)
                if ident in copies and _link_copy(copies[ident], root_fd, name, d_fd):
                    continue
                if budget is not None and st.st_size > budget:
                    left_out += 1
                    continue
                _copy_file(name, s_fd, d_fd, stat.S_IMODE(st.st_mode))
                if budget is not None:
                    budget -= st.st_size
                if st.st_nlink > 1:
                    copies[ident] = "/".join([*(f.name for f in stack.frames[1:]), name])
            else:
                continue
            if owners:
                os.chown(name, st.st_uid, st.st_gid, dir_fd=d_fd, follow_symlinks=False)
    finally:
        os.close(root_fd)
        stack.close()
    top = os.stat(src)
    os.chmod(dst, stat.S_IMODE(top.st_mode) | 0o700)
    if owners:
        os.chown(dst, top.st_uid, top.st_gid)
    return left_out


def _link_copy(first: str, root_fd: int, name: str, d_fd: int) -> bool:
    """Make ``name`` another name of the copy at ``first`` (relative to the copy's root); False where the path
    is too long for the kernel (a very deep tree), and the file is copied instead."""
    try:
        os.link(first, name, src_dir_fd=root_fd, dst_dir_fd=d_fd, follow_symlinks=False)
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG:
            raise
        return False
    return True


def _copy_file(name: str, s_fd: int, d_fd: int, mode: int) -> None:
    fin = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=s_fd)
    try:
        fout = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode & 0o777, dir_fd=d_fd)
        try:
            while os.sendfile(fout, fin, None, 1 << 24) > 0:
                pass
        finally:
            os.close(fout)
    finally:
        os.close(fin)
