"""Killing every process of a sandbox uid before the uid is handed out again (clawpipe.sandbox.uids).

A ``kill(-1, SIGKILL)`` from a helper running as the uid reaches every process of it in the kernel's one
pass over all processes, which no fork slips through (a process that keeps changing its pid, forking and
exiting, can be missing from every scan of /proc). Scans of /proc then wait until nothing of the uid runs,
and signal what is left through pidfds (never a pid reused meanwhile). A process whose main thread exited
while its other threads run shows as a zombie: it counts as running.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time

from clawpipe.errors import SandboxError

logger = logging.getLogger(__name__)

SWEEP_DEADLINE_S = 5.0
_KILL = next((k for k in ("/usr/bin/kill", "/bin/kill") if shutil.which(k)), None)  # procps or util-linux


def processes_of(uid: int) -> list[int]:
    """Pids of live processes whose real, effective, saved or filesystem uid is ``uid`` (a zombie counts only
    while threads of its process still run)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and _runs_as(int(name), uid):
            found.append(int(name))
    return found


def _runs_as(pid: int, uid: int) -> bool:
    try:  # raw descriptors: this runs for every process on the host when a uid is released
        fd = os.open(f"/proc/{pid}/status", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        text = os.read(fd, 1024)  # State: and Uid: come within the first few hundred bytes
    except OSError:
        return False
    finally:
        os.close(fd)
    state = uids = b""
    for line in text.split(b"\n"):
        if line.startswith(b"State:"):
            state = line
        elif line.startswith(b"Uid:"):
            uids = line
            break
    if str(uid).encode() not in uids.split()[1:]:
        return False
    # A main thread that ends alone (SYS_exit, not exit_group) leaves a zombie leader whose other threads run on.
    return b"Z" not in state.split()[1:2] or _threads_alive(pid)


def _threads_alive(pid: int) -> bool:
    try:
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except OSError:
        return False


def _kill_all_as(uid: int) -> bool:
    """``kill(-1, SIGKILL)`` from a helper running as ``uid``: the kernel signals every process of the uid in one
    pass that a fork cannot slip through, also one that keeps changing its pid (forks, then exits) faster than
    /proc can be read. False where no helper could run (not root, no kill program)."""
    if _KILL is None or os.geteuid() != 0:  # only root may become another uid
        return False
    try:
        subprocess.run(
            [_KILL, "-KILL", "-1"],
            user=uid,
            group=uid,
            extra_groups=[],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            env={},
            timeout=SWEEP_DEADLINE_S,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        logger.debug("kill -1 as uid %d failed: %s", uid, exc)
        return False
    return True


def _kill_each(pids: list[int], uid: int) -> tuple[int, int]:
    """SIGKILL each of ``pids`` still running as ``uid``; returns (signalled, refused with EPERM)."""
    killed = refused = 0
    for pid in pids:
        try:  # through a pidfd, re-checked after opening: a pid reused meanwhile is never signalled
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            if _runs_as(pid, uid):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                killed += 1
        except PermissionError:
            refused += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return killed, refused


def kill_processes_of(uid: int, deadline_s: float = SWEEP_DEADLINE_S) -> None:
    """SIGKILL every process running as ``uid`` until none is left. Raises SandboxError when some survive
    ``deadline_s`` or this runner may not signal them (not root).

    Costs one kill helper and one scan of /proc when nothing runs as ``uid`` (the usual case)."""
    deadline = time.monotonic() + deadline_s
    everyone = _kill_all_as(uid)  # unconditionally: a pid-hopping process may be in no scan at all
    while pids := processes_of(uid):
        if time.monotonic() > deadline:
            raise SandboxError(f"{len(pids)} processes of sandbox uid {uid} survive SIGKILL (pids {pids[:5]})")
        if everyone:
            _kill_all_as(uid)
        signalled, refused = _kill_each(pids, uid)
        if refused and not signalled and not everyone:
            raise SandboxError(
                f"this runner (uid {os.geteuid()}) may not signal the {len(pids)} processes of sandbox uid {uid} "
                f"(pids {pids[:5]}): run the runner as root, or end them (e.g. remove the leftover containers)"
            )
        time.sleep(0.01)
