"""Hostile code under a sandboxed check: a solution that forks a setsid() daemon and then hangs with SIGTERM
ignored, and one that leaves such a daemon behind and returns at once. The check ends at its timeout (or
when the check exits), scores 0 for the broken function, and nothing it started runs on afterwards."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from clawpipe.sandbox.backends import Backend
from clawpipe.sandbox.verify import verify_rollout
from clawpipe.tasks import fixit, get_task_set
from tests.sandbox.support import procs_with

FIXIT = get_task_set("fixit")

DAEMON = """
import os, signal
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execvp("sleep", ["sleep", "{marker}"])
    os._exit(0)
"""
HANG = """
for _s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(_s, signal.SIG_IGN)
while True:
    pass
"""
WRONG = "def {f}(a, b):\n    return a - b\n"


def _add_task() -> dict[str, Any]:
    return next(t for t in FIXIT.generate(40, seed=0) if t["data"]["template"] == "add")


@pytest.mark.sandbox
@pytest.mark.slow
@pytest.mark.parametrize("tail", ["hang", "return"])
def test_a_forking_or_hanging_check_ends_and_leaves_nothing_running(
    tmp_path: Path, bwrap: Backend, monkeypatch: pytest.MonkeyPatch, tail: str
) -> None:
    monkeypatch.setattr(fixit, "CHECK_TIMEOUT_S", 2.0)
    marker = f"{900 + int(uuid.uuid4().int % 99)}.{os.getpid()}"  # sleep takes it as a number of seconds
    task = _add_task()
    solution = (
        DAEMON.format(marker=marker) + (HANG if tail == "hang" else "") + WRONG.format(f=task["data"]["function"])
    )
    (tmp_path / "solution.py").write_text(solution)
    t0 = time.monotonic()
    reward, info = verify_rollout(FIXIT, task, tmp_path, bwrap)
    elapsed = time.monotonic() - t0
    assert reward == 0.0, info
    if tail == "hang":
        assert info["timed_out"] and info["reason"] == "timeout", info
    else:
        assert not info["timed_out"] and "cases passed" in info["reason"], info
    assert elapsed < 15, elapsed
    assert procs_with(marker) == []  # the daemon died with the check's sandbox
