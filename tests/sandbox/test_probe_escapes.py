"""Hostile harnesses reaching past the sandbox by ways the network namespace does not cover, and holding more
of the host than their limits say: a vsock socket (straight to the hypervisor of a virtual machine), the
runner's own open-file limit, and core dumps (into the work dir the host reads back, or to the host's core
helper)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from clawpipe.sandbox import load_manifest
from clawpipe.sandbox.limits import SANDBOX_NOFILE
from tests.sandbox.support import EchoTaskSet, Upstream, make_harness, run_harnesses

BACKENDS = [pytest.param("bwrap", marks=pytest.mark.sandbox), pytest.param("docker", marks=pytest.mark.docker)]

REACHER = r"""
import errno, json, os, resource, signal, socket

res = {}

def family(name, fam, kind):
    try:
        socket.socket(fam, kind).close()
        res[name] = "created"
    except OSError as exc:
        res[name] = errno.errorcode.get(exc.errno, str(exc.errno))

family("vsock_stream", socket.AF_VSOCK, socket.SOCK_STREAM)
family("vsock_dgram", socket.AF_VSOCK, socket.SOCK_DGRAM)
family("inet", socket.AF_INET, socket.SOCK_STREAM)
family("inet6", socket.AF_INET6, socket.SOCK_STREAM)
family("unix", socket.AF_UNIX, socket.SOCK_STREAM)

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
res["nofile"] = [soft, hard]
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard + 1, hard + 1))
    res["nofile_raised"] = True
except (ValueError, OSError):
    res["nofile_raised"] = False
resource.setrlimit(resource.RLIMIT_NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE)[1:] * 2)
held = []
try:
    while len(held) < 100_000:
        held.append(os.open("/dev/null", os.O_RDONLY))
    res["open_error"] = None
except OSError as exc:
    res["open_error"] = errno.errorcode.get(exc.errno)
res["opened"] = len(held)
for fd in held:
    os.close(fd)

core_hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
try:  # as high as the hard limit lets it
    resource.setrlimit(resource.RLIMIT_CORE, (core_hard, core_hard))
except (ValueError, OSError):
    pass
res["core"] = list(resource.getrlimit(resource.RLIMIT_CORE))
child = os.fork()
if child == 0:
    os.kill(os.getpid(), signal.SIGSEGV)
    os._exit(0)
_, status = os.waitpid(child, 0)
res["child_signal"] = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
res["core_dumped"] = os.WCOREDUMP(status)
res["core_files"] = sorted(n for n in os.listdir(".") if n.startswith("core"))
with open(os.path.join(os.environ["CLAWPIPE_OUTPUT"], "reach.json"), "w") as f:
    json.dump(res, f)
"""


def _run_one(backend: str, tmp_path: Path, upstream: Upstream, echo: EchoTaskSet, script: str) -> dict[str, Any]:
    m = load_manifest(make_harness(tmp_path, "reacher", script))
    res = run_harnesses([m], upstream, tmp_path, echo, backend=backend, keep_workdirs=True)
    assert res[0].status == "succeeded", (res[0].status, res[0].error, res[0].stderr_tail[-1000:])
    return json.loads((Path(res[0].workdir or "") / "out" / "reach.json").read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_vsock_no_runner_file_limit_and_no_core_dump_from_a_sandbox(
    backend: str, tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    reach = _run_one(backend, tmp_path, upstream, echo, REACHER)
    # vsock is refused by the sandbox's filter, whether or not this machine has vsock at all; the other
    # families still open (the network namespace is what confines them)
    assert (reach["vsock_stream"], reach["vsock_dgram"]) == ("EPERM", "EPERM"), reach
    assert (reach["inet"], reach["inet6"], reach["unix"]) == ("created", "created", "created"), reach
    # open files: the sandbox's own cap, which it cannot raise, not the runner's (raised for the bridge)
    assert reach["nofile"] == [SANDBOX_NOFILE, SANDBOX_NOFILE] and reach["nofile_raised"] is False, reach
    assert reach["open_error"] == "EMFILE" and reach["opened"] < SANDBOX_NOFILE, reach
    # a crash leaves no core behind: not in the work dir, not with the host's core helper
    assert reach["core"] == [0, 0], reach
    assert reach["child_signal"] == 11 and reach["core_dumped"] is False and reach["core_files"] == [], reach
