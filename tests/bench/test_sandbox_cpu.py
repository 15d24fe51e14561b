"""The sandbox bench's CPU counter sees the processes bwrap forks into the sandbox's PID namespace, which
rusage of reaped children misses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

BUSY = """
import os, time
x = 0
while time.process_time() < 0.3:
    x += 1
open(os.path.join(os.environ["CLAWPIPE_OUTPUT"], "cpu.txt"), "w").write(str(time.process_time()))
"""

# In a child process: the counter moves its process into a cgroup before any sandbox starts, as the bench does.
PROBE = """
import json, os, resource, sys, tempfile
from pathlib import Path
sys.path.insert(0, "bench")
import sandbox_throughput as st
from clawpipe.sandbox import load_manifest
from clawpipe.sandbox.backends import SandboxJob, get_backend
from clawpipe.sandbox.bridge import Bridge
from tests.sandbox.support import Upstream, make_harness

def rusage():
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

cpu = st.CpuCounter()
tmp = Path(tempfile.mkdtemp())
up = Upstream()
try:
    m = load_manifest(make_harness(tmp, "busy", sys.argv[1]))
    rdir = tmp / "run"
    (rdir / "work" / "out").mkdir(parents=True)
    (rdir / "task.json").write_text("{}")
    for p in (rdir / "work", rdir / "work" / "out"):
        os.chown(p, 65534, 65534)
    backend = get_backend("bwrap")
    with Bridge(up.url) as bridge:
        c0, r0 = cpu.read(), rusage()
        out = backend.run(SandboxJob("busy", m, rdir, "k", "m", 30.0, m.limits), bridge)
        c1, r1 = cpu.read(), rusage()
    backend.close()
    harness = float((rdir / "work" / "out" / "cpu.txt").read_text())
    print(json.dumps({"kind": cpu.kind, "exit": out.exit_code, "counter": c1 - c0, "rusage": r1 - r0,
                      "harness": harness}))
finally:
    up.close()
    cpu.close()
"""


@pytest.mark.sandbox
@pytest.mark.slow
def test_counter_sees_the_harness_inside_bwraps_pid_namespace() -> None:
    if os.geteuid() != 0 or not any("cpuacct" in line for line in Path("/proc/self/cgroup").read_text().splitlines()):
        pytest.skip("needs root and a cgroup v1 cpuacct hierarchy (the counter falls back to rusage elsewhere)")
    out = subprocess.run(
        [sys.executable, "-c", PROBE, BUSY], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["exit"] == 0 and r["kind"].startswith("cgroup v1 cpuacct")
    assert r["harness"] >= 0.3
    assert r["counter"] >= r["harness"], r  # the whole sandbox: the harness and what set it up
    assert r["rusage"] < r["harness"], r  # what the bench counted before: the harness is missing
    assert not Path(r["kind"].split(" of ", 1)[1]).exists(), "the counter's cgroup is removed when it closes"
