"""Per-sandbox host uids: concurrent sandboxes share none of the kernel's per-uid budgets.

Two rollouts run at once. The "hog" takes a budget the kernel keeps per uid (inotify instances, POSIX
message queue bytes) until the kernel refuses, holds it, and tells a loopback rendezvous server; the
"neighbour" waits for that, then needs the same budget. With one uid for every sandbox the neighbour
fails; with a uid per sandbox it succeeds.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from clawpipe.sandbox import RolloutSpec, run_rollouts
from clawpipe.sandbox.uids import UidPool
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
