"""Per-sandbox host uids: concurrent sandboxes share none of the kernel's per-uid budgets.

Two rollouts run at once. The "hog" takes a budget the kernel keeps per uid (inotify instances, POSIX
message queue bytes) until the kernel refuses, holds it, and tells a loopback rendezvous server; the
"neighbour" waits for that, then needs the same budget. With one uid for every sandbox the neighbour
fails; with a uid per sandbox it succeeds.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from clawpipe.config import get_settings
from clawpipe.errors import ConfigError, SandboxError
from clawpipe.sandbox import Limits, RolloutSpec, run_rollouts, uids
from clawpipe.sandbox.backends import get_backend
from clawpipe.sandbox.backends.docker import maps_host_uids
from clawpipe.sandbox.limits import NPROC_SHARE, apply_rlimits
from clawpipe.sandbox.sweep import kill_processes_of, processes_of
from clawpipe.sandbox.uids import (
    SHARED_USER,
    UidLease,
    UidPool,
    unmapped_ids,
    validate_range,
)
from tests.sandbox.support import EchoTaskSet, make_harness

BACKENDS = [pytest.param("bwrap", marks=pytest.mark.sandbox), pytest.param("docker", marks=pytest.mark.docker)]

# Takes one per-uid budget (data.budget) until the kernel refuses (the hog) or needs one of it (the
# neighbour). The two meet through the rendezvous server behind the bridge: /hog-ready, /wait-hog, /done.
BUDGET_HARNESS = r"""
import ctypes, json, os, pathlib, urllib.request
task = json.loads(pathlib.Path(os.environ["CLAWPIPE_TASK"]).read_text())
data = task["data"]
out = pathlib.Path(os.environ["CLAWPIPE_OUTPUT"])
libc = ctypes.CDLL(None, use_errno=True)
libc.mq_open.restype = ctypes.c_int
libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]

def call(path):
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + path, data=b"{}", method="POST")
    return urllib.request.urlopen(req, timeout=60).read()

def take(i):
    if data["budget"] == "inotify":
        return libc.inotify_init1(0)
    return libc.mq_open(f"/q{os.getpid()}-{i}".encode(), os.O_CREAT | os.O_RDWR, 0o600, None)

report = {"uid": [os.getuid(), os.geteuid(), os.getgid()], "name": None}
for line in open("/etc/passwd"):
    f = line.split(":")
    if int(f[2]) == os.getuid():
        report["name"] = f[0]
if data["role"] == "hog":
    n = 0
    while n < 100000:
        if take(n) < 0:
            report["stopped_by"] = os.strerror(ctypes.get_errno())
            break
        n += 1
    report["taken"] = n
    (out / "report.json").write_text(json.dumps(report))
    call("/hog-ready")
    call("/wait-done")  # hold everything until the neighbour has tried
else:
    call("/wait-hog")
    fd = take(0)
    report["neighbour"] = "ok" if fd >= 0 else os.strerror(ctypes.get_errno())
    (out / "report.json").write_text(json.dumps(report))
    call("/done")
    if fd < 0:
        raise SystemExit(1)
(out / "answer.txt").write_text("42")
"""


class Rendezvous:
    """A loopback server the two sandboxes reach through their bridges: each POST path sets or waits for an
    event, so the neighbour tries only while the hog holds its budget."""

    def __init__(self) -> None:
        self.hog_ready = threading.Event()
        self.done = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path.endswith("/hog-ready"):
                    outer.hog_ready.set()
                elif self.path.endswith("/done"):
                    outer.done.set()
                elif self.path.endswith("/wait-hog"):
                    outer.hog_ready.wait(45)
                elif self.path.endswith("/wait-done"):
                    outer.done.wait(45)
                self.send_response(200)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def run_pair(tmp: Path, backend: str, budget: str, **options: Any) -> list[dict[str, Any]]:
    """Run the hog and its neighbour at once; return their reports (hog first) after checking both rows."""
    harness = make_harness(tmp, "budget", BUDGET_HARNESS, timeout_s=90)
    tasks = EchoTaskSet().generate(2)
    for task, role in zip(tasks, ("hog", "neighbour"), strict=True):
        task["data"].update(role=role, budget=budget)
    specs = [RolloutSpec(run_id="u", iteration=0, harness=str(harness), task=t, model="m") for t in tasks]
    meet = Rendezvous()
    try:
        res = run_rollouts(
            specs,
            proxy_url=meet.url,
            backend=backend,
            concurrency=2,
            results_path=tmp / "results.jsonl",
            secret=b"uid-test",
            scratch_dir=tmp / "scratch",
            task_sets={"echo": EchoTaskSet()},
            keep_workdirs=True,
            **options,
        )
    finally:
        meet.close()
    reports = []
    for r in res:
        path = Path(r.workdir or "") / "out" / "report.json"
        reports.append(json.loads(path.read_text()) if path.is_file() else {"status": r.status, "err": r.stderr_tail})
    assert meet.hog_ready.is_set(), reports
    for r, rep in zip(res, reports, strict=True):
        rep["status"] = r.status
    return reports


def in_range(uid: int, pool: UidPool) -> bool:
    return pool.base <= uid < pool.base + pool.count


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("budget", ["inotify", "mqueue"])
def test_a_sandbox_exhausting_a_per_uid_budget_leaves_its_neighbour_its_own(
    backend: str, budget: str, tmp_path: Path
) -> None:
    hog, neighbour = run_pair(tmp_path, backend, budget)
    pool = UidPool.from_settings()
    # The hog reached the kernel's per-uid cap (not a descriptor limit: 128 instances, ~800 kB of queues).
    assert hog["stopped_by"] == "Too many open files" and 0 < hog["taken"] <= 1024, hog
    assert neighbour["neighbour"] == "ok" and neighbour["status"] == "succeeded", neighbour
    assert hog["status"] == "succeeded", hog
    # Each ran as its own uid from the clawpipe range (real = effective, gid the same number), named "sandbox".
    for rep in (hog, neighbour):
        uid, euid, gid = rep["uid"]
        assert uid == euid == gid and in_range(uid, pool), rep
        assert rep["name"] == "sandbox", rep
    assert hog["uid"][0] != neighbour["uid"][0]


# --- the uid pool itself: exclusive across processes, cleaned after a killed holder, validated ---

HOLDER = r"""
import subprocess, sys, time
from pathlib import Path
from clawpipe.sandbox.uids import UidPool, processes_of
pool = UidPool(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
lease = pool.lease()
if sys.argv[4] == "stray":  # a process of the sandbox's uid that outlives its runner (like a container)
    stray = subprocess.Popen(
        ["setpriv", f"--reuid={lease.user.uid}", f"--regid={lease.user.gid}", "--clear-groups", "sleep", "600"],
        start_new_session=True,
    )
    while stray.pid not in processes_of(lease.user.uid):  # setpriv has changed its uid
        time.sleep(0.01)
    print(lease.user.uid, stray.pid, flush=True)
else:
    print(lease.user.uid, 0, flush=True)
time.sleep(600)
"""

BASE = 1_900_000  # a range of the tests' own, so no runner of another test takes these uids


def start_holder(tmp: Path, count: int, mode: str = "plain") -> tuple[subprocess.Popen[str], int, int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(BASE), str(count), str(tmp / "locks"), mode],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.stdout is not None
    uid, stray = map(int, proc.stdout.readline().split())
    return proc, uid, stray


def stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()


@pytest.mark.sandbox
def test_concurrent_runners_never_share_a_uid_and_a_dead_runners_uid_comes_back(tmp_path: Path) -> None:
    a, uid_a, _ = start_holder(tmp_path, 3)
    b, uid_b, _ = start_holder(tmp_path, 3)
    try:
        mine = UidPool(BASE, 3, tmp_path / "locks").lease()  # a third holder, in this process
        assert sorted({uid_a, uid_b, mine.user.uid}) == [BASE, BASE + 1, BASE + 2]
        assert mine.user.gid == mine.user.uid
        with pytest.raises(SandboxError, match="all 3 sandbox uids from 1900000 are in use"):
            UidPool(BASE, 3, tmp_path / "locks").lease(wait_s=0.2)
        stop(a)  # SIGKILL: no release ran, the kernel dropped its lock
        again = UidPool(BASE, 3, tmp_path / "locks").lease(wait_s=5)
        assert again.user.uid == uid_a
        again.release()
        mine.release()
    finally:
        stop(a)
        stop(b)


@pytest.mark.sandbox
def test_a_uid_left_by_a_killed_runner_is_reused_only_after_its_stray_processes_are_killed(tmp_path: Path) -> None:
    holder, uid, stray = start_holder(tmp_path, 1, "stray")
    try:
        assert stray in processes_of(uid)
        stop(holder)  # the runner dies; its sandbox's process lives on under the uid
        assert stray in processes_of(uid)
        lease = UidPool(BASE, 1, tmp_path / "locks").lease(wait_s=5)
        assert lease.user.uid == uid
        assert processes_of(uid) == []  # killed before the uid was handed out again
        lease.release()
        assert (tmp_path / "locks" / f"{uid}.lock").read_bytes() == b""  # released clean: no sweep next time
    finally:
        stop(holder)
        with contextlib.suppress(ProcessLookupError):
            os.kill(stray, signal.SIGKILL)


def test_uid_ranges_are_validated_with_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"within \[1, 4294967294\]"):
        validate_range(0, 10)
    with pytest.raises(ConfigError, match=r"within \[1, 4294967294\]"):
        validate_range(2**32 - 10, 100)
    with pytest.raises(ConfigError, match=r"overlaps host users or groups \(1, 2, 3.*move the range"):
        validate_range(1, 65534)  # daemon (1), bin, sys ... and nobody (65534) are inside
    with pytest.raises(ConfigError, match=r"fewer than the 8 sandboxes.*CLAWPIPE_SANDBOX_UID_COUNT to at least 8"):
        validate_range(BASE, 4, concurrency=8)
    monkeypatch.setenv("CLAWPIPE_SANDBOX_UID_BASE", "1000")  # where the first real users live
    get_settings.cache_clear()
    try:
        with pytest.raises(ConfigError, match="overlaps host users"):
            UidPool.from_settings()
    finally:
        monkeypatch.delenv("CLAWPIPE_SANDBOX_UID_BASE")
        get_settings.cache_clear()


def test_a_runner_refuses_more_sandboxes_at_once_than_its_uid_range_holds(tmp_path: Path) -> None:
    spec = RolloutSpec(
        run_id="u",
        iteration=0,
        harness=str(make_harness(tmp_path, "h", "pass\n")),
        task=EchoTaskSet().generate(1)[0],
        model="m",
    )
    meet = Rendezvous()  # something answers at the proxy's address: only the range is wrong
    try:
        with pytest.raises(ConfigError, match="holds 2 uids, fewer than the 4 sandboxes"):
            run_rollouts(
                [spec],
                proxy_url=meet.url,
                backend="bwrap",
                concurrency=4,
                secret=b"s",
                results_path=tmp_path / "results.jsonl",
                uid_pool=UidPool(BASE, 2, tmp_path / "l"),
            )
    finally:
        meet.close()


def test_without_a_usable_lock_folder_sandboxes_share_uid_65534_and_say_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    loose.chmod(0o777)  # anyone could plant lock files: not trusted
    with caplog.at_level(logging.WARNING, logger="clawpipe.sandbox.uids"):
        lease = UidPool(BASE, 4, loose).lease()
    assert lease.user == SHARED_USER
    assert "every sandbox runs as the shared uid 65534" in caplog.text and "chmod 700" in caplog.text
    lease.release()


def test_the_rlimit_fallback_caps_processes_at_pids_exactly_for_a_uid_of_the_sandboxs_own() -> None:
    caps = {}
    for shared in (True, False):
        proc = subprocess.Popen(["sleep", "30"])
        try:
            apply_rlimits(proc.pid, Limits(pids=7), {"pids"}, 10.0, shared_uid=shared)
            caps[shared] = resource.prlimit(proc.pid, resource.RLIMIT_NPROC)
        finally:
            proc.kill()
            proc.wait()
    assert caps[False] == (7, 7)  # its own uid: only its processes count
    assert caps[True] == (7 * NPROC_SHARE, 7 * NPROC_SHARE)  # uid 65534: every such sandbox counts


def test_a_link_in_place_of_a_lock_file_skips_that_uid_alone(tmp_path: Path) -> None:
    pool = UidPool(BASE, 2, tmp_path / "locks")
    pool.lease().release()  # makes the folder
    (tmp_path / "locks" / f"{BASE}.lock").unlink()
    (tmp_path / "locks" / f"{BASE}.lock").symlink_to(tmp_path / "elsewhere")
    lease = pool.lease(wait_s=0)
    assert lease.user.uid == BASE + 1 and not (tmp_path / "elsewhere").exists()
    with pytest.raises(SandboxError, match=rf"1 could not be locked, e\.g\. .*{BASE}\.lock: Too many levels"):
        pool.lease(wait_s=0)
    lease.release()


def test_rootless_or_remapping_docker_engines_are_told_apart_from_ones_that_take_host_uids() -> None:
    assert maps_host_uids(["name=apparmor", "name=seccomp,profile=builtin"])
    assert not maps_host_uids(["name=seccomp,profile=builtin", "name=rootless"])
    assert not maps_host_uids(["name=userns"])


@pytest.mark.sandbox
def test_a_backend_that_cannot_take_the_range_runs_its_sandboxes_as_65534(tmp_path: Path) -> None:
    harness = make_harness(
        tmp_path,
        "who",
        "import os\nopen(os.environ['CLAWPIPE_OUTPUT'] + '/answer.txt', 'w').write(str(os.getuid()))\n",
    )
    backend = get_backend("bwrap")
    backend.own_uids = False  # type: ignore[attr-defined]  # as a rootless Docker engine says of itself
    meet = Rendezvous()
    try:
        res = run_rollouts(
            [RolloutSpec(run_id="u", iteration=0, harness=str(harness), task=EchoTaskSet().generate(1)[0], model="m")],
            proxy_url=meet.url,
            backend=backend,
            results_path=tmp_path / "results.jsonl",
            secret=b"s",
            scratch_dir=tmp_path / "scratch",
            task_sets={"echo": EchoTaskSet()},
            keep_workdirs=True,
        )
    finally:
        meet.close()
        backend.close()
    assert res[0].status == "succeeded", res[0].stderr_tail
    assert (Path(res[0].workdir or "") / "out" / "answer.txt").read_text() == "65534"  # and its work dir was its own


def test_a_range_outside_a_narrow_user_namespace_map_falls_back_to_the_shared_uid_and_says_why(tmp_path: Path) -> None:
    """In a container whose id map is narrow, setuid to an unmapped id fails: every sandbox would fail to
    start. The pool sees it in /proc/self/uid_map and falls back to uid 65534 with a warning naming the fix."""
    assert unmapped_ids(BASE, 4) is None  # this host maps every id
    code = (
        "import logging, sys\n"
        "from pathlib import Path\n"
        "from clawpipe.sandbox.uids import UidPool, unmapped_ids\n"
        "logging.basicConfig(level=logging.WARNING, stream=sys.stdout)\n"
        f"print('unmapped:', unmapped_ids({BASE}, 4))\n"
        f"print('user:', UidPool({BASE}, 4, Path({str(tmp_path / 'locks')!r})).lease().user.uid)\n"
    )
    # a user namespace that maps only uid/gid 0, as a narrow container map would
    out = subprocess.run(
        ["unshare", "--user", "--map-root-user", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr
    assert f"unmapped: uid {BASE}" in out.stdout
    assert "user: 65534" in out.stdout and "CLAWPIPE_SANDBOX_UID_BASE" in out.stdout


# --- the sweep: processes that try to slip past it ---

# Its main thread ends alone (SYS_exit, not exit_group): /proc shows the process as a zombie while its other
# thread runs on.
LONE_THREAD = r"""
import ctypes, os, threading, time
threading.Thread(target=time.sleep, args=(600,)).start()
print(os.getpid(), flush=True)
ctypes.CDLL(None, use_errno=True).syscall(60, 0)
"""

# A chain whose every link forks the next and exits, so its pid changes all the time; it writes to the pipe
# it inherited every 20 links, which shows whether it still runs without looking for it in /proc.
PID_HOPPER = r"""
import os, sys
fd, n = int(sys.argv[1]), 0
while True:
    if os.fork() != 0:
        os._exit(0)
    n += 1
    if n % 20 == 0:
        os.write(fd, b".")
"""


def as_uid(uid: int, *argv: str) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]


def kill_all_of(uid: int) -> None:
    """The tests' own cleanup, whatever the sweep under test did."""
    subprocess.run(as_uid(uid, "kill", "-KILL", "-1"), capture_output=True, check=False)


@pytest.mark.sandbox
def test_a_process_whose_main_thread_exited_is_found_and_killed_by_the_sweep() -> None:
    uid = BASE + 40
    proc = subprocess.Popen(as_uid(uid, sys.executable, "-c", LONE_THREAD), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        pid = int(proc.stdout.readline())
        deadline = time.monotonic() + 10
        while "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert len(os.listdir(f"/proc/{pid}/task")) == 2  # a zombie leader, one thread alive
        assert processes_of(uid) == [pid]
        kill_processes_of(uid, deadline_s=3)
        assert proc.wait(timeout=5) == -signal.SIGKILL  # the whole process ended, its live thread too
    finally:
        kill_all_of(uid)
        proc.kill()
        proc.wait()


def read_until_eof(fd: int, timeout_s: float) -> bool:
    """Drain ``fd``; True when every writer has closed it within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if select.select([fd], [], [], left)[0] and not os.read(fd, 65536):
            return True
    return False


@pytest.mark.sandbox
def test_a_process_that_keeps_changing_its_pid_is_killed_by_the_sweep() -> None:
    uid = BASE + 41
    r, w = os.pipe()
    try:
        cmd = as_uid(uid, sys.executable, "-c", PID_HOPPER, str(w))
        subprocess.run(cmd, pass_fds=(w,), timeout=30, check=True)  # its first link exits at once
        os.close(w)
        w = -1
        seen = b""
        while len(seen) < 5:  # the chain runs: 100 links
            assert select.select([r], [], [], 20)[0], "the chain did not start"
            seen += os.read(r, 16)
        kill_processes_of(uid, deadline_s=3)
        assert read_until_eof(r, 3.0), "the chain outlived the sweep"
    finally:
        kill_all_of(uid)
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)


def test_a_range_that_meets_a_users_subordinate_ids_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """useradd gives every user 65536 subordinate ids from 100000 on (/etc/subuid): the 16th user's reach the
    default range. Their rootless containers run as those uids, which the sweep would kill."""
    subuid, subgid = tmp_path / "subuid", tmp_path / "subgid"
    subuid.write_text(f"alice:100000:65536\nbob:{BASE - 10}:65536\n")
    subgid.write_text("alice:100000:65536\n")
    monkeypatch.setattr(uids, "SUBID_FILES", (str(subuid), str(subgid)))
    with pytest.raises(ConfigError, match=rf"overlaps the subordinate ids of {subuid} \(bob {BASE - 10}-"):
        validate_range(BASE, 4)
    with pytest.raises(ConfigError, match="subordinate ids"):
        UidPool(BASE, 4, tmp_path / "locks")
    validate_range(BASE + 65536, 4)  # clear of both ranges
    subgid.write_text(f"carol:{BASE + 65536 + 2}:10\n")  # a group range counts too
    with pytest.raises(ConfigError, match=rf"{subgid} \(carol"):
        validate_range(BASE + 65536, 4)


@pytest.mark.sandbox
def test_a_lock_folder_on_a_read_only_disk_falls_back_to_65534_and_names_the_setting(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"  # like a container's read-only /run, where /run/clawpipe does not exist yet
    run.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(run)], check=True)
    try:
        with caplog.at_level(logging.WARNING, logger="clawpipe.sandbox.uids"):
            lease = UidPool(BASE, 4, run / "clawpipe" / "sandbox-uids").lease()
    finally:
        subprocess.run(["umount", str(run)], check=False)
    assert lease.user == SHARED_USER
    assert "Read-only file system" in caplog.text and "CLAWPIPE_SANDBOX_UID_LOCKS" in caplog.text, caplog.text
    assert "every sandbox runs as the shared uid 65534" in caplog.text
    lease.release()


@pytest.mark.sandbox
def test_a_runner_that_may_not_signal_a_uids_processes_says_so_at_once() -> None:
    """A runner that is not root (docker as a member of the docker group) cannot kill what a killed runner's
    containers left running: the sweep says so at once instead of retrying until its deadline."""
    uid = BASE + 42
    stray = subprocess.Popen(as_uid(uid, "sleep", "60"))
    try:
        while stray.pid not in processes_of(uid):
            time.sleep(0.01)
        t0 = time.monotonic()
        os.seteuid(BASE + 43)  # this process, as another unprivileged uid, for the sweep alone
        try:
            with pytest.raises(SandboxError, match=rf"may not signal the 1 processes of sandbox uid {uid}.*root"):
                kill_processes_of(uid, deadline_s=5)
        finally:
            os.seteuid(0)
        assert time.monotonic() - t0 < 4  # the old sweep retried until its 5 s deadline
        assert stray.poll() is None
    finally:
        stray.kill()
        stray.wait()


# --- what a uid's sandbox could leave for the next sandbox of the same uid ---

# "make" leaves one of everything that outlives processes where it is shared: a POSIX message queue, SysV
# shared memory, a SysV queue and semaphores, files in /tmp and /dev/shm; "look" (the next holder of the uid)
# looks for each of them.
IPC_HARNESS = r"""
import ctypes, json, os, pathlib
task = json.loads(pathlib.Path(os.environ["CLAWPIPE_TASK"]).read_text())
libc = ctypes.CDLL(None, use_errno=True)
libc.mq_open.restype = ctypes.c_int
libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
KEY, IPC_CREAT = 0x5A17, 0o1000
make = task["data"]["role"] == "make"
flags = (os.O_CREAT | os.O_RDWR) if make else os.O_RDONLY
ipc = IPC_CREAT | 0o600 if make else 0
found = {
    "mqueue": libc.mq_open(b"/clawpipe-left", flags, 0o600, None) >= 0,
    "shm": libc.shmget(KEY, 4096, ipc) >= 0,
    "msg": libc.msgget(KEY, ipc) >= 0,
    "sem": libc.semget(KEY, 1, ipc) >= 0,
}
for d in ("/tmp", "/dev/shm"):
    if make:
        pathlib.Path(d, "left").write_text("x")
    found[d] = pathlib.Path(d, "left").exists()
found["uid"] = os.getuid()
pathlib.Path(os.environ["CLAWPIPE_OUTPUT"], "report.json").write_text(json.dumps(found))
"""


def sysv_ids_of(uid: int) -> list[str]:
    """Rows of the host namespace's /proc/sysvipc tables that name ``uid`` (as owner or creator)."""
    rows = []
    for kind in ("shm", "msg", "sem"):
        for line in Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]:
            if str(uid) in line.split():
                rows.append(f"{kind}: {line}")
    return rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_ipc_objects_and_temporary_files_of_a_sandbox_never_reach_the_next_sandbox_of_its_uid(
    backend: str, tmp_path: Path
) -> None:
    harness = make_harness(tmp_path, "ipc", IPC_HARNESS)
    tasks = EchoTaskSet().generate(2)
    for task, role in zip(tasks, ("make", "look"), strict=True):
        task["data"]["role"] = role
    pool = UidPool(BASE + 44, 1, tmp_path / "locks")  # one uid: both sandboxes run as it, one after the other
    reports = []
    meet = Rendezvous()
    try:
        for task in tasks:
            res = run_rollouts(
                [RolloutSpec(run_id="ipc", iteration=0, harness=str(harness), task=task, model="m")],
                proxy_url=meet.url,
                backend=backend,
                concurrency=1,
                results_path=tmp_path / "results.jsonl",
                secret=b"s",
                scratch_dir=tmp_path / "scratch",
                task_sets={"echo": EchoTaskSet()},
                keep_workdirs=True,
                uid_pool=pool,
            )
            assert res[0].status == "succeeded", res[0].stderr_tail
            reports.append(json.loads((Path(res[0].workdir or "") / "out" / "report.json").read_text()))
            assert sysv_ids_of(BASE + 44) == []  # nothing of the uid in the host's own IPC namespace
    finally:
        meet.close()
    made, looked = reports
    assert made["uid"] == looked["uid"] == BASE + 44
    assert all(made[k] for k in ("mqueue", "shm", "msg", "sem", "/tmp", "/dev/shm")), made
    assert not any(looked[k] for k in ("mqueue", "shm", "msg", "sem", "/tmp", "/dev/shm")), looked


# --- many sandboxes at once, from two runners sharing the host's range ---

# Says which uid it ran as and when; "slow" outlives the runner's timeout (killed), the rest end at once.
TIMED_HARNESS = r"""
import json, os, pathlib, time
task = json.loads(pathlib.Path(os.environ["CLAWPIPE_TASK"]).read_text())
start = time.time()
time.sleep(30 if task["data"].get("slow") else 0.1)
out = pathlib.Path(os.environ["CLAWPIPE_OUTPUT"])
(out / "report.json").write_text(json.dumps({"uid": os.getuid(), "start": start, "end": time.time()}))
(out / "answer.txt").write_text("42")
"""


def open_files() -> list[str]:
    """What this process's descriptors point at."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
    return out


class FailingPrepareTaskSet(EchoTaskSet):
    """Its prepare() raises for tasks marked "broken": a rollout whose setup fails after its uid was taken."""

    def prepare(self, task: dict[str, Any], workdir: Path) -> None:
        if task["data"].get("broken"):
            raise RuntimeError("this task cannot be prepared")
        super().prepare(task, workdir)


@pytest.mark.slow
@pytest.mark.sandbox
def test_two_runners_with_many_sandboxes_at_once_never_share_a_uid_and_give_every_uid_back(tmp_path: Path) -> None:
    harness = make_harness(tmp_path, "timed", TIMED_HARNESS)
    count, per_runner, concurrency = 16, 25, 8  # 2 x 8 sandboxes at once on 16 uids: every uid in use
    locks = tmp_path / "locks"
    meet = Rendezvous()
    results: dict[str, list[Any]] = {}
    errors: list[BaseException] = []

    def runner(name: str) -> None:
        tasks = FailingPrepareTaskSet().generate(per_runner, seed=len(name))
        tasks[3]["data"]["slow"] = True  # killed at the timeout
        tasks[7]["data"]["broken"] = True  # its setup raises
        specs = [RolloutSpec(run_id=name, iteration=0, harness=str(harness), task=t, model="m") for t in tasks]
        try:
            results[name] = run_rollouts(
                specs,
                proxy_url=meet.url,
                backend="bwrap",
                concurrency=concurrency,
                results_path=tmp_path / f"results-{name}.jsonl",
                secret=b"s",
                scratch_dir=tmp_path / "scratch",
                task_sets={"echo": FailingPrepareTaskSet()},
                keep_workdirs=True,
                timeout_s=3,
                max_attempts=1,
                uid_pool=UidPool(BASE + 100, count, locks),  # a pool of its own, as in another process
            )
        except BaseException as exc:  # reported below
            errors.append(exc)

    fds = len(open_files())
    threads = [threading.Thread(target=runner, args=(n,)) for n in ("a", "bb")]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        meet.close()
    assert not errors, errors
    spans: dict[int, list[tuple[float, float]]] = {}
    statuses = []
    for res in results.values():
        for r in res:
            statuses.append(r.status)
            report = Path(r.workdir or "") / "out" / "report.json"
            if report.is_file():
                rep = json.loads(report.read_text())
                spans.setdefault(rep["uid"], []).append((rep["start"], rep["end"]))
    assert statuses.count("succeeded") == 2 * (per_runner - 2), statuses
    assert statuses.count("timeout") == 2 and statuses.count("infra_error") == 2, statuses
    assert set(spans) <= set(range(BASE + 100, BASE + 100 + count)) and len(spans) > concurrency
    for uid, runs in spans.items():  # one uid, one sandbox at a time
        runs.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(runs)), (uid, runs)
    left = open_files()
    assert len(left) <= fds and not [f for f in left if str(locks) in f], left  # no lock file left open
    pool = UidPool(BASE + 100, count, locks)
    held = [pool.lease(wait_s=0) for _ in range(count)]  # every uid free again, also after the kill and the raise
    assert sorted(h.user.uid for h in held) == list(range(BASE + 100, BASE + 100 + count))
    assert all((locks / f"{u}.lock").stat().st_size > 0 for u in range(BASE + 100, BASE + 100 + count))
    for h in held:
        h.release()
    assert all((locks / f"{u}.lock").read_bytes() == b"" for u in range(BASE + 100, BASE + 100 + count))
    assert str(tmp_path) not in Path("/proc/self/mounts").read_text()  # the failed setups' quota tmpfs too


SLOW_RELEASE_S = 4.0


class SlowSweepPool(UidPool):
    """A pool whose releases take SLOW_RELEASE_S, far longer than a sweep on a host running many thousands of
    processes (a tenth of a second), so that a rollout which waited for one shows it whatever the load."""

    def lease(self, wait_s: float = 60.0) -> UidLease:
        lease = super().lease(wait_s)
        release = lease.release

        def slow() -> None:
            time.sleep(SLOW_RELEASE_S)
            release()

        lease.release = slow  # type: ignore[method-assign]
        return lease


@pytest.mark.sandbox
def test_a_slow_uid_release_is_off_the_rollouts_path_and_done_before_the_batch_returns(tmp_path: Path) -> None:
    harness = make_harness(tmp_path, "timed", TIMED_HARNESS)
    specs = [
        RolloutSpec(run_id="slow", iteration=0, harness=str(harness), task=t, model="m")
        for t in EchoTaskSet().generate(4)
    ]
    pool = SlowSweepPool(BASE + 200, 4, tmp_path / "locks")
    meet = Rendezvous()
    try:
        res = run_rollouts(
            specs,
            proxy_url=meet.url,
            backend="bwrap",
            concurrency=2,
            results_path=tmp_path / "results.jsonl",
            secret=b"s",
            scratch_dir=tmp_path / "scratch",
            task_sets={"echo": EchoTaskSet()},
            uid_pool=pool,
        )
    finally:
        meet.close()
    assert [r.status for r in res] == ["succeeded"] * 4
    # no rollout waited for a release (a 0.1 s harness takes well under a second, a few under load)
    assert max(r.duration_s or 0.0 for r in res) < SLOW_RELEASE_S, [r.duration_s for r in res]
    held = [UidPool(BASE + 200, 4, tmp_path / "locks").lease(wait_s=0) for _ in range(4)]  # all given back already
    for h in held:
        h.release()


@pytest.mark.docker
def test_a_killed_runners_docker_container_is_stopped_before_its_uid_is_handed_out_again(tmp_path: Path) -> None:
    """Containers outlive the runner that started them (the engine is their parent): a uid whose holder died
    is handed out again only after the container's processes, seen in the host's /proc, are killed."""
    import docker

    from clawpipe.sandbox.backends.docker import ensure_image

    uid = BASE + 45
    client = docker.from_env()
    locks = tmp_path / "locks"
    UidPool(uid, 1, locks).lease(wait_s=0).release()  # makes the folder
    (locks / f"{uid}.lock").write_text("999999\n")  # its holder (a runner) died holding it
    box = client.containers.run(
        ensure_image(client),
        ["/usr/bin/sleep", "600"],
        detach=True,
        user=f"{uid}:{uid}",
        network_mode="none",
        volumes={"/usr": {"bind": "/usr", "mode": "ro"}},
    )
    try:
        deadline = time.monotonic() + 30
        while not processes_of(uid):
            assert time.monotonic() < deadline, "the container did not start"
            time.sleep(0.05)
        lease = UidPool(uid, 1, locks).lease(wait_s=5)
        assert lease.user.uid == uid and processes_of(uid) == []
        box.reload()
        assert box.wait(timeout=30)["StatusCode"] == 128 + signal.SIGKILL  # the container ended, SIGKILLed
        lease.release()
    finally:
        box.remove(force=True)
        client.close()
