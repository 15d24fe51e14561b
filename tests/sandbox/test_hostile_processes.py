"""Hostile process trees: a harness that double-forks a setsid() daemon and exits 0 while the daemon keeps
writing its results, one that ignores SIGTERM and closes its stdout, one whose child keeps stdout open after
it exits. Each rollout ends when its harness does (or at its timeout), nothing of it runs on afterwards, and
what the verifier read is what the work dir still holds."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from clawpipe.sandbox import RolloutSpec, load_manifest, run_rollouts
from clawpipe.sandbox.manifest import HarnessManifest
from tests.sandbox.support import EchoTaskSet, Upstream, make_harness, procs_with

BACKENDS = [pytest.param("bwrap", marks=pytest.mark.sandbox), pytest.param("docker", marks=pytest.mark.docker)]

# Exits 0 as soon as its grandchild, in a session of its own, has begun appending to out/answer.txt (every 5 ms
# for a minute).
DAEMON_WRITER = r"""
import os, sys, time
out = os.environ["CLAWPIPE_OUTPUT"]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        for fd in (0, 1, 2):
            os.close(fd)
        deadline = time.time() + 60
        while time.time() < deadline:
            with open(os.path.join(out, "answer.txt"), "a") as f:
                f.write("42\n")
            time.sleep(0.005)
        os._exit(0)
    os._exit(0)
deadline = time.time() + 30
while not os.path.exists(os.path.join(out, "answer.txt")) and time.time() < deadline:
    time.sleep(0.01)  # exit once the daemon has written (a fixed sleep could end first on a loaded machine)
"""

# Ignores SIGTERM (and SIGHUP, SIGINT), closes its stdout and stderr, and keeps running.
STUBBORN = r"""
import os, signal, time
for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(sig, signal.SIG_IGN)
os.close(1)
os.close(2)
while True:
    time.sleep(1)
"""

# Exits 0 while its child, holding the same stdout and stderr, sleeps for a minute.
HOLDER = r"""
import os, sys, time
if os.fork() == 0:
    time.sleep(60)
    os._exit(0)
print("parent done", flush=True)
"""


def _marked(root: Path, name: str, script: str, marker: str, **manifest: Any) -> HarnessManifest:
    """A harness whose every process carries ``marker`` on its command line."""
    return load_manifest(make_harness(root, name, script, command=["python3", "main.py", marker], **manifest))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.slow
def test_escaped_daemons_stubborn_and_stdout_holding_harnesses_end_with_their_rollout(
    backend: str, tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    marker = f"hostile-{uuid.uuid4().hex[:10]}"
    harnesses = {
        "daemon": _marked(tmp_path, "daemon", DAEMON_WRITER, marker),
        "stubborn": _marked(tmp_path, "stubborn", STUBBORN, marker, timeout_s=2),
        "holder": _marked(tmp_path, "holder", HOLDER, marker),
    }
    tasks = echo.generate(len(harnesses))
    specs = [
        RolloutSpec(run_id="p", iteration=0, harness=m, task=tasks[i], model="m", rollout_id=name)
        for i, (name, m) in enumerate(harnesses.items())
    ]
    t0 = time.monotonic()
    res = {
        r.rollout_id: r
        for r in run_rollouts(
            specs,
            proxy_url=upstream.url,
            backend=backend,
            concurrency=3,
            results_path=tmp_path / "results.jsonl",
            secret=b"s",
            scratch_dir=tmp_path / "scratch",
            task_sets={"echo": echo},
            keep_workdirs=True,
        )
    }
    elapsed = time.monotonic() - t0
    assert elapsed < 30, elapsed  # nobody waited for the minute-long children
    assert procs_with(marker) == []  # nothing of any of them runs on
    assert (res["stubborn"].status, res["holder"].status) == ("timeout", "succeeded"), res
    assert res["holder"].duration_s < 15, res["holder"].duration_s
    daemon = res["daemon"]
    assert daemon.status == "succeeded" and daemon.exit_code == 0, daemon
    answer = Path(daemon.workdir or "") / "out" / "answer.txt"
    written = answer.read_text()
    assert written.startswith("42\n")  # the daemon did run before its harness exited
    time.sleep(0.5)
    assert answer.read_text() == written  # and wrote nothing after the rollout ended
