"""A rollout result file whose writer was SIGKILLed mid-line, appended to by the next writer: the torn line is one
reject naming it, and every whole row after it lands."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clawpipe import capture
from clawpipe.lake import land, run_sql
from tests.lake import fixtures as fx

ROOT = Path(__file__).resolve().parents[2]

# Appends result rows of 32 MB each (a long stderr_tail) until killed: a kill inside one write leaves a torn line.
_WRITER = """
import sys
from clawpipe.capture import append_result
from tests.lake import fixtures as fx
path = sys.argv[1]
for i in range(1000):
    append_result(path, fx.rollout_row(f"big{i}", stderr_tail="x" * (32 << 20)))
"""


def _torn_by_a_kill(path: Path) -> int:
    """Kill a writer of ``path`` while a line is half written; returns the torn line's offset."""
    for _attempt in range(20):
        path.unlink(missing_ok=True)
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], cwd=ROOT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            size = path.stat().st_size if path.exists() else 0
            if size and not _ends_a_line(path, size):  # a write under way: kill it there
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        data = path.read_bytes() if path.exists() else b""
        if data and not data.endswith(b"\n"):
            return data.rfind(b"\n") + 1
    raise AssertionError("20 kills in a row fell between two writes")


def _ends_a_line(path: Path, size: int) -> bool:
    with open(path, "rb") as f:
        f.seek(size - 1)
        return f.read(1) == b"\n"


@pytest.mark.slow
def test_a_row_appended_after_a_torn_line_lands(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    path = cap / "results" / "run1" / "0" / "results-b0.jsonl"
    path.parent.mkdir(parents=True)
    torn = _torn_by_a_kill(path)
    whole = path.read_bytes().count(b"\n")
    capture.append_result(path, fx.rollout_row("after"))  # the next writer of the file: a rerun, say
    fx.write_segment(cap / "p-0.seg", [fx.record(call_id="c0", rollout_id="after")])
    rep = land(cap, lake)
    assert rep.rollouts == whole + 1
    got = run_sql(lake, "select rollout_id from rollouts where rollout_id = 'after'").to_pylist()
    assert got == [{"rollout_id": "after"}]
    rejects = run_sql(lake, 'select source, "offset" from rejects').to_pylist()
    assert rejects == [{"source": "results/run1/0/results-b0.jsonl", "offset": torn}]
