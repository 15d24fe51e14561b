"""A harness that runs into a limit set on purpose learns which one from its result row: the time limit, the
memory limit (filled through its /tmp, whose pages count toward it), and the process limit of a fork bomb
each name their value and the setting that raises it; before, the row said only `timeout` or `oom`, and a
refused fork said nothing at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from clawpipe.sandbox import load_manifest
from tests.sandbox.support import EchoTaskSet, Upstream, make_harness, run_harnesses

SLEEPER = "import time\ntime.sleep(60)\n"

# Fills /tmp (a tmpfs charged to the sandbox's memory) in files under the disk quota's file-size limit.
TMP_FILLER = r"""
chunk = b"x" * (1 << 20)
for i in range(1000):
    with open(f"/tmp/fill{i}", "wb") as f:
        for _ in range(16):
            f.write(chunk)
"""

# Forks sleepers until the kernel refuses one, then exits 1 (its children die with the sandbox).
FORKER = r"""
import os, sys, time
n = 0
while True:
    try:
        pid = os.fork()
    except OSError as exc:
        print(f"fork {n} refused: {exc}", file=sys.stderr)
        sys.exit(1)
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    n += 1
"""


@pytest.mark.sandbox
@pytest.mark.slow
def test_each_limit_a_harness_runs_into_is_named_with_its_setting(
    tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    harnesses = [
        make_harness(tmp_path, "sleeper", SLEEPER, timeout_s=1),
        make_harness(tmp_path, "filler", TMP_FILLER, resources={"memory_mb": 64, "disk_mb": 32}),
        make_harness(tmp_path, "forker", FORKER, resources={"pids": 12}),
    ]
    res = run_harnesses([load_manifest(h) for h in harnesses], upstream, tmp_path, echo, backend="bwrap", concurrency=3)
    by_name = {r.harness: r for r in res}
    timeout, oom, forks = by_name["sleeper"], by_name["filler"], by_name["forker"]
    assert timeout.status == "timeout" and timeout.error is not None, (timeout.status, timeout.error)
    assert "time limit of 1 s" in timeout.error and "timeout_s" in timeout.error, timeout.error
    assert oom.status == "oom" and oom.error is not None, (oom.status, oom.error, oom.stderr_tail[-500:])
    assert "memory limit of 64 MB" in oom.error and "memory_mb" in oom.error and "/tmp" in oom.error, oom.error
    assert forks.status == "failed" and "refused" in forks.stderr_tail, (forks.status, forks.stderr_tail[-500:])
    assert forks.error is not None and "limit of 12" in forks.error and "[resources] pids" in forks.error, forks.error


@pytest.mark.sandbox
def test_without_a_memory_cgroup_the_error_names_the_address_space_limit(
    tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    from clawpipe.sandbox.backends.bwrap import BwrapBackend
    from clawpipe.sandbox.limits import CgroupLayout

    hog = "chunks = []\nfor _ in range(100):\n    chunks.append(b'x' * (16 << 20))\n"
    m = load_manifest(make_harness(tmp_path, "hog", hog, resources={"memory_mb": 128}))
    backend = BwrapBackend(cgroups=CgroupLayout(version=0))  # as where no cgroup is writable: rlimits only
    try:
        res = run_harnesses([m], upstream, tmp_path, echo, backend=backend)
    finally:
        backend.close()
    assert res[0].status == "oom" and res[0].error is not None, (res[0].status, res[0].error)
    assert "MemoryError" in res[0].error and "limit of 128 MB" in res[0].error and "memory_mb" in res[0].error
    assert "/tmp" not in res[0].error, res[0].error  # the rlimit does not count files: the row does not say so
