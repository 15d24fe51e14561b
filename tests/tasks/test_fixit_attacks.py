"""The real fixit verifier in a real bwrap sandbox against malicious solutions.

The verification runs in a child process started the way a runner is: the proxy secret and the admin
token in its environment (so /proc/<pid>/environ of the verifying process holds them) and a clawpipe home
holding the secret files. Each solution is otherwise wrong (the planted bug) and tries one attack at import
time, printing what it got as one ``REPORT {...}`` line; none raises the reward above the honest wrong
attempt's 0, none sees a secret, none reaches the network, none writes where it should not.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clawpipe.tasks import get_task_set

pytestmark = pytest.mark.sandbox

FIXIT = get_task_set("fixit")
PROXY_SECRET = "proxy-secret-7f3a9c01d2e4"
ADMIN_TOKEN = "admin-token-5be81d77aa90"
REPO = Path(__file__).resolve().parents[2]

# Shared by every attack: a report printed at import time, and the planted bug (wrong values).
PRELUDE = """
import json, os, socket
SECRETS = __SECRETS__
REPORT = {}

def scan(what, path):
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except Exception as exc:
        REPORT[what] = type(exc).__name__
        return
    REPORT[what] = "LEAK" if any(s.encode() in data for s in SECRETS) else "read-clean"

def attempt_write(what, path, data="1"):
    try:
        with open(path, "w") as f:
            f.write(data)
        REPORT[what] = "WROTE"
    except Exception as exc:
        REPORT[what] = type(exc).__name__

"""
WRONG = "\ndef {f}(a, b):\n    return a - b\n"
ATTACKS = {
    "proc-of-parent": """
ppid = os.getppid()
for name in ("environ", "cmdline"):
    scan(f"parent-{name}", f"/proc/{ppid}/{name}")
    scan(f"pid1-{name}", f"/proc/1/{name}")
for pid in (p for p in os.listdir("/proc") if p.isdigit()):
    scan(f"proc-{pid}-environ", f"/proc/{pid}/environ")
""",
    "home-secrets": """
for i, path in enumerate(__HOST_PATHS__):
    scan(f"host-file-{i}", path)
""",
    "network": """
for i, (host, port) in enumerate(__TARGETS__):
    try:
        socket.create_connection((host, port), timeout=1).close()
        REPORT[f"connect-{i}"] = "CONNECTED"
    except OSError as exc:
        REPORT[f"connect-{i}"] = type(exc).__name__
""",
    "always-equal": """
class AlwaysEqual:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__

class EqualInt(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__

REPORT["eq"] = "returning objects"
""",
    "forged-result": """
forged = {"results": [{"value": True, "passed": True}] * 5, "reward": 1.0, "passed": 5, "total": 5}
text = json.dumps(forged)
print(text, flush=True)
out = os.environ["CLAWPIPE_OUTPUT"]
try:
    os.unlink(os.path.join(out, "result.json"))
    os.symlink("/etc/passwd", os.path.join(out, "result.json"))
    REPORT["relink-result"] = "WROTE"
except OSError as exc:
    REPORT["relink-result"] = type(exc).__name__
with open(os.path.join(out, "result.json"), "w") as f:
    f.write(text)
REPORT["forged"] = "written"
print("REPORT " + json.dumps(REPORT), flush=True)
os._exit(0)
""",
    "proc-and-file-writes": """
attempt_write("drop-caches", "/proc/sys/vm/drop_caches", "3")
attempt_write("pid1-oom-adj", "/proc/1/oom_score_adj", "-1000")
attempt_write("kernel-hostname", "/proc/sys/kernel/hostname", "pwned")
attempt_write("check-program", "/harness/check.py", "raise SystemExit(0)")
attempt_write("new-file-in-workdir", os.path.join(os.environ["CLAWPIPE_WORKDIR"], "planted.py"), "x")
attempt_write("overwrite-own-copy", os.path.join(os.environ["CLAWPIPE_WORKDIR"], "solution.py"), "x")
attempt_write("etc", "/etc/passwd", "x")
""",
}
RETURNS = {
    "always-equal": "\nCALLS = []\ndef {f}(a, b):\n    CALLS.append(1)\n"
    "    return AlwaysEqual() if len(CALLS) % 2 else EqualInt(0)\n",
}
DENIED_WRITE = {"PermissionError", "OSError", "FileNotFoundError", "IsADirectoryError"}

# Runs in the child process: verify each work dir with the real bwrap backend, print the results.
VERIFY = """
import json, sys
from pathlib import Path
from clawpipe.sandbox.backends import get_backend
from clawpipe.sandbox.verify import verify_rollout
from clawpipe.tasks import get_task_set
fixit = get_task_set("fixit")
task = json.loads(sys.argv[1])
backend = get_backend("bwrap")
out = {}
for work in sys.argv[2:]:
    reward, info = verify_rollout(fixit, task, Path(work), backend)
    out[Path(work).parent.name] = [reward, info]
backend.close()
import os
environ = open("/proc/self/environ", "rb").read()
held = [os.environ[k].encode() in environ for k in ("CLAWPIPE_PROXY_SECRET", "CLAWPIPE_ADMIN_TOKEN")]
out["verifier-environ"] = [all(held), {}]
print(json.dumps(out))
"""


def host_ip() -> str | None:
    """This machine's address on its default route (no packet is sent), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return None


@pytest.fixture(scope="module")
def listener() -> Iterator[socket.socket]:
    """A TCP listener on every host address standing in for the proxy: nothing may connect to it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("0.0.0.0", 0))
    sock.listen(16)
    sock.setblocking(False)
    try:
        yield sock
    finally:
        sock.close()


@pytest.fixture(scope="module")
def verified(tmp_path_factory: pytest.TempPathFactory, listener: socket.socket) -> dict[str, Any]:
    """Every attack and the honest wrong attempt, verified in one child process that holds the secrets."""
    root = tmp_path_factory.mktemp("attacks")
    home = root / "home"
    home.mkdir()
    (home / "secret").write_text(PROXY_SECRET)
    (home / "admin_token").write_text(ADMIN_TOKEN)
    task = next(t for t in FIXIT.generate(40, seed=0) if t["data"]["template"] == "add")
    f = task["data"]["function"]
    port = listener.getsockname()[1]
    targets = [("127.0.0.1", port)] + ([(ip, port)] if (ip := host_ip()) else [])
    fill = {
        "secrets": [PROXY_SECRET, ADMIN_TOKEN],
        "host_paths": [
            str(home / "secret"),
            str(home / "admin_token"),
            str(root / "task.json"),
            str(REPO / "README.md"),
        ],
        "targets": targets,
    }
    works = []
    for name in ["honest-wrong", *ATTACKS]:
        work = root / name / "work"
        work.mkdir(parents=True)
        (work.parent / "task.json").write_text(json.dumps(task))  # as the runner lays it out: beside the work dir
        FIXIT.prepare(task, work)
        if name != "honest-wrong":
            body = PRELUDE + ATTACKS[name]
            for token, value in fill.items():
                body = body.replace(f"__{token.upper()}__", repr(value))
            body += "\nprint('REPORT ' + json.dumps(REPORT), flush=True)\n"
            (work / "solution.py").write_text(body + RETURNS.get(name, WRONG).format(f=f))
        works.append(str(work))
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "CLAWPIPE_HOME": str(home),
        "CLAWPIPE_PROXY_SECRET": PROXY_SECRET,
        "CLAWPIPE_ADMIN_TOKEN": ADMIN_TOKEN,
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.run(
        [sys.executable, "-c", VERIFY, json.dumps(task), *works], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"results": json.loads(proc.stdout.splitlines()[-1]), "works": works}


def report(info: dict[str, Any]) -> dict[str, str]:
    lines = [line for line in info.get("output_tail", "").splitlines() if line.startswith("REPORT ")]
    assert lines, f"the solution printed no report: {info}"
    return json.loads(lines[-1].removeprefix("REPORT "))


def test_the_verifying_process_held_the_secrets(verified: dict[str, Any]) -> None:
    assert verified["results"]["verifier-environ"][0] is True  # in its /proc/<pid>/environ, there to steal


def test_the_honest_wrong_attempt_scores_zero(verified: dict[str, Any]) -> None:
    reward, info = verified["results"]["honest-wrong"]
    assert reward == 0.0 and info["reason"] == "0/10 cases passed"  # 5 shown, 5 held out


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_an_attack_gains_nothing_and_sees_no_secret(verified: dict[str, Any], attack: str) -> None:
    honest = verified["results"]["honest-wrong"][0]
    reward, info = verified["results"][attack]
    assert reward <= honest and reward == 0.0, info
    text = json.dumps(info)
    assert PROXY_SECRET not in text and ADMIN_TOKEN not in text
    assert "/tmp/" not in text and str(REPO) not in text  # no host path in the reward info
    seen = report(info)
    assert "LEAK" not in seen.values() and "CONNECTED" not in seen.values() and "WROTE" not in seen.values(), seen


def test_proc_shows_no_host_process_and_parent_environ_is_closed(verified: dict[str, Any]) -> None:
    seen = report(verified["results"]["proc-of-parent"][1])
    assert seen["parent-environ"] == "PermissionError" and seen["pid1-environ"] == "PermissionError"
    pids = {k.split("-")[1] for k in seen if k.startswith("proc-") and k.endswith("-environ")}
    assert pids and all(int(p) < 10 for p in pids), pids  # its own pid namespace: a handful of pids, no host ones


def test_host_files_are_not_there(verified: dict[str, Any]) -> None:
    seen = report(verified["results"]["home-secrets"][1])
    assert set(seen.values()) == {"FileNotFoundError"}, seen


def test_no_address_answers(verified: dict[str, Any], listener: socket.socket) -> None:
    seen = report(verified["results"]["network"][1])
    assert seen and all(v in ("ConnectionRefusedError", "OSError", "TimeoutError") for v in seen.values()), seen
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing reached the listener standing in for the proxy


def test_custom_eq_objects_are_not_json(verified: dict[str, Any]) -> None:
    info = verified["results"]["always-equal"][1]
    failures = [f["got"] for f in info["failures"]]
    assert info["passed"] == 0 and "not JSON serializable" in failures[0]  # AlwaysEqual()
    assert failures[1] == '{"value": 0}'  # EqualInt(0) serialises as the plain 0 it is


def test_a_forged_document_is_compared_by_value(verified: dict[str, Any]) -> None:
    reward, info = verified["results"]["forged-result"]
    assert reward == 0.0 and info["passed"] == 0
    assert report(info)["relink-result"] == "PermissionError"  # out/ belongs to root: the file stays a file


def test_writes_to_proc_and_read_only_places_fail(verified: dict[str, Any]) -> None:
    seen = report(verified["results"]["proc-and-file-writes"][1])
    assert set(seen.values()) <= DENIED_WRITE, seen
    for work in verified["works"]:
        assert not (Path(work) / "planted.py").exists()
