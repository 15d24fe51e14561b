"""bwrap parity with Docker's defaults: the seccomp filter, a fresh session keyring per sandbox, and no key or
host path on any command line (real bwrap sandboxes)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from clawpipe.keys import mint_key
from clawpipe.sandbox import RolloutSpec, load_manifest, run_rollouts
from clawpipe.sandbox.backends.bwrap import join_fresh_session_keyring
from clawpipe.sandbox.seccomp import ARCHES, SYSCALLS, build_filter
from tests.sandbox.support import URLLIB_HARNESS, EchoTaskSet, Sampler, Upstream, make_harness

SECRET = b"hardening-secret"

PROBE = r"""
import ctypes, json, os, pathlib, subprocess, threading, time
data = json.loads(pathlib.Path(os.environ["CLAWPIPE_TASK"]).read_text())["data"]
nr = data["syscalls"]
libc = ctypes.CDLL(None, use_errno=True)
res = {}

def call(name, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr[name]), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    return [r, os.strerror(ctypes.get_errno()) if r < 0 else ""]

p = subprocess.run(["unshare", "-Ur", "true"], capture_output=True, text=True)
res["unshare_Ur"] = [p.returncode, p.stderr.strip()]
res["unshare_user"] = call("unshare", 0x10000000)
res["clone_newuser"] = call("clone", 0x10000000 | 17, 0, 0, 0, 0)
res["setns"] = call("setns", 0, 0)
res["keyctl_session"] = call("keyctl", 0, -3, 1)  # KEYCTL_GET_KEYRING_ID of @s, create
res["add_key"] = call("add_key", b"user", b"stolen", b"x", 1, -4)  # into @u
res["request_key"] = call("request_key", b"user", data["key_name"].encode(), None, 0)
res["ptrace"] = call("ptrace", 0, 0, 0, 0)  # PTRACE_TRACEME
res["mount"] = call("mount", b"none", b"/tmp", b"tmpfs", 0, None)
res["umount2"] = call("umount2", b"/proc", 2)
res["bpf"] = call("bpf", 0, 0, 0)
res["perf_event_open"] = call("perf_event_open", 0, 0, -1, -1, 0)
res["finit_module"] = call("finit_module", 0, b"", 0)
res["kexec_load"] = call("kexec_load", 0, 0, 0, 0)
res["io_uring_setup"] = call("io_uring_setup", 4, ctypes.create_string_buffer(120))  # kernel exploits' favourite
res["io_uring_register"] = call("io_uring_register", 0, 0, 0, 0)
t = threading.Thread(target=lambda: res.__setitem__("thread", "ok")); t.start(); t.join()
res["subprocess"] = subprocess.run(["true"]).returncode
cmdlines = {}
for d in pathlib.Path("/proc").iterdir():
    if d.name.isdigit():
        try:
            cmdlines[d.name] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            pass
res["cmdlines"] = cmdlines
pathlib.Path(os.environ["CLAWPIPE_OUTPUT"], "probe.json").write_text(json.dumps(res))
open(os.path.join(os.environ["CLAWPIPE_OUTPUT"], "answer.txt"), "w").write("42")
time.sleep(1.0)  # stay alive while the host looks at its process list
"""


class HostPs(Sampler):
    """Every command line on the host while it runs (what `ps` shows), sampled every 20 ms."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def sample(self) -> None:
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    self.seen.add((d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
                except OSError:
                    pass


@pytest.mark.sandbox
@pytest.mark.slow
def test_docker_default_denials_fresh_keyrings_and_no_key_on_any_command_line(
    tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    arch = ARCHES[platform.machine()]
    m = load_manifest(make_harness(tmp_path / "h", "probe", PROBE))
    tasks = echo.generate(2)
    for t in tasks:
        t["data"].update(syscalls={k: v[arch.column] for k, v in SYSCALLS.items()}, key_name="stolen")
    specs = [RolloutSpec(run_id="hard", iteration=0, harness=m, task=t, model="m") for t in tasks]
    scratch = tmp_path / "scratch"
    with HostPs() as ps:
        res = run_rollouts(
            specs,
            proxy_url=upstream.url,
            backend="bwrap",
            concurrency=2,
            results_path=tmp_path / "results.jsonl",
            secret=SECRET,
            scratch_dir=scratch,
            task_sets={"echo": echo},
            keep_workdirs=True,
        )
    assert [r.status for r in res] == ["succeeded", "succeeded"], [r.stderr_tail[-500:] for r in res]
    keys = [mint_key(SECRET, run_id="hard", iteration=0, rollout_id=r.rollout_id) for r in res]
    for r in res:
        probe = json.loads((Path(r.workdir or "") / "out" / "probe.json").read_text())
        assert probe["unshare_Ur"][0] != 0 and "Operation not permitted" in probe["unshare_Ur"][1]
        for name in ("unshare_user", "clone_newuser", "setns", "keyctl_session", "add_key", "request_key"):
            assert probe[name] == [-1, "Operation not permitted"], (name, probe[name])
        for name in (
            *("ptrace", "mount", "umount2", "bpf", "perf_event_open", "finit_module", "kexec_load"),
            *("io_uring_setup", "io_uring_register"),
        ):
            assert probe[name] == [-1, "Operation not permitted"], (name, probe[name])
        assert probe["thread"] == "ok" and probe["subprocess"] == 0  # threads and fork still work
        inside = " ".join(probe["cmdlines"].values())
        assert " --args " in probe["cmdlines"]["1"] and "--setenv" not in probe["cmdlines"]["1"]
        for secret_or_path in [*keys, str(scratch), str(tmp_path)]:
            assert secret_or_path not in inside
    on_host = "\n".join(ps.seen)
    assert "--args" in on_host  # the sampler saw the sandboxes
    for key in keys:
        assert key not in on_host


def _session_keyring_of_child() -> int:
    """The session keyring serial that a freshly started process has."""
    code = (
        "import ctypes, platform; libc = ctypes.CDLL(None, use_errno=True); "
        "nr = {'x86_64': 250, 'aarch64': 219}[platform.machine()]; "
        "print(libc.syscall(ctypes.c_long(nr), ctypes.c_long(0), ctypes.c_long(-3), ctypes.c_long(0)))"
    )
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def test_each_launch_gets_a_fresh_session_keyring() -> None:
    """What the bwrap backend does before each sandbox: the launching thread joins a new session keyring, and
    the process it starts inherits that one, not the runner's nor a previous sandbox's."""
    before = _session_keyring_of_child()
    seen: list[tuple[int, int]] = []

    def launch() -> None:
        joined = join_fresh_session_keyring()
        seen.append((joined, _session_keyring_of_child()))

    for _ in range(2):
        t = threading.Thread(target=launch)
        t.start()
        t.join()
    assert all(joined > 0 and joined == child for joined, child in seen), seen
    assert len({child for _, child in seen} | {before}) == 3
    assert _session_keyring_of_child() == before  # the main thread's own keyring is untouched


def test_filter_program_shape_and_numbers() -> None:
    for arch in ARCHES.values():
        prog = build_filter(arch)
        assert len(prog) % 8 == 0 and len(prog) // 8 < 100
    header = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
    if platform.machine() == "x86_64" and header.is_file():  # the table agrees with this machine's kernel headers
        text = header.read_text()
        for name, (x86, _) in SYSCALLS.items():
            assert f"#define __NR_{name} {x86}\n" in text, name


SLOW_CALL = URLLIB_HARNESS + "\nimport time\ntime.sleep(3)  # while the test inspects the container\n"


@pytest.mark.docker
@pytest.mark.slow
def test_docker_inspect_shows_no_key(tmp_path: Path, upstream: Upstream, echo: EchoTaskSet, docker_host: str) -> None:
    """The key reaches the harness (its call is attributed), yet the container's Env, Cmd and Args never hold it."""
    import docker

    from clawpipe.sandbox.backends.docker import LABEL

    client = docker.DockerClient(base_url=docker_host)
    m = load_manifest(make_harness(tmp_path / "h", "slow", SLOW_CALL))
    spec = RolloutSpec(run_id="insp", iteration=0, harness=m, task=echo.generate(1)[0], model="m")
    key = mint_key(SECRET, run_id="insp", iteration=0, rollout_id=spec.id)
    inspected: list[dict[str, Any]] = []

    def inspect() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(a["Name"].startswith("/cp-run") for a in inspected):
            for c in client.containers.list(filters={"label": LABEL}):
                inspected.append(client.api.inspect_container(c.id))
            time.sleep(0.1)

    watcher = threading.Thread(target=inspect, daemon=True)
    watcher.start()
    res = run_rollouts(
        [spec],
        proxy_url=upstream.url,
        backend="docker",
        results_path=tmp_path / "results.jsonl",
        secret=SECRET,
        scratch_dir=tmp_path / "scratch",
        task_sets={"echo": echo},
    )
    watcher.join()
    client.close()
    assert (res[0].status, res[0].reward, res[0].n_calls) == ("succeeded", 1.0, 1), res[0].stderr_tail[-500:]
    runs = [a for a in inspected if a["Name"].startswith("/cp-run")]
    assert runs and runs[0]["Args"][-2:] == ["python3", "/harness/main.py"]
    for attrs in inspected:
        assert key not in json.dumps(attrs)
