"""Process facts shared by the rooms that leave marks on disk for a process (the sandbox's rollout folders,
the proxy's capture flush requests) and must tell whether that process is still there."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (one owned by another user counts: signalling it is refused)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
