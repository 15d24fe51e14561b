"""Hostile harnesses looking for the host's secrets and for a way out of the network: a harness sees no
variable of the runner's environment, no host process, none of the host's secret files, and reaches nothing
but its proxy route (no other loopback port, no IPv6 loopback, no abstract unix socket, no Docker socket)."""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clawpipe.sandbox import RolloutSpec, load_manifest, run_rollouts
from tests.sandbox.support import EchoTaskSet, Upstream, make_harness

BACKENDS = [pytest.param("bwrap", marks=pytest.mark.sandbox), pytest.param("docker", marks=pytest.mark.docker)]

# Values planted in the runner's environment; none may be found anywhere inside a sandbox.
PLANTED = {
    "AWS_SECRET_ACCESS_KEY": "aws-planted-4f1c9e",
    "MLFLOW_TRACKING_TOKEN": "mlflow-planted-8a2d71",
    "CLAWPIPE_ADMIN_TOKEN": "admin-planted-55b0c3",
    "CLAWPIPE_SECRET": "secret-planted-e93a04",
}

SEEKER = r"""
import json, os, socket, pathlib
out = pathlib.Path(os.environ["CLAWPIPE_OUTPUT"])
data = json.loads(pathlib.Path(os.environ["CLAWPIPE_TASK"]).read_text())["data"]
res = {"found": [], "pids": [], "reads": {}, "connects": {}}
wanted = data["planted"]

def scan(where, blob):
    text = blob.decode("utf-8", "replace") if isinstance(blob, bytes) else blob
    for value in wanted:
        if value in text:
            res["found"].append(where)

scan("env", json.dumps(dict(os.environ)))
for pid in os.listdir("/proc"):
    if not pid.isdigit():
        continue
    res["pids"].append(int(pid))
    for name in ("environ", "cmdline"):
        try:
            scan(f"/proc/{pid}/{name}", pathlib.Path(f"/proc/{pid}/{name}").read_bytes())
        except OSError:
            pass
for path in data["reads"]:
    try:
        if os.path.isdir(path):
            res["reads"][path] = sorted(os.listdir(path))
            scan(path, "\n".join(res["reads"][path]))
        else:
            scan(path, pathlib.Path(path).read_bytes())
            res["reads"][path] = "ok"
    except OSError as exc:
        res["reads"][path] = type(exc).__name__

def attempt(name, family, address):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(address)
        res["connects"][name] = "ok"
    except OSError as exc:
        res["connects"][name] = type(exc).__name__
    finally:
        s.close()

attempt("loopback_other_port", socket.AF_INET, ("127.0.0.1", data["tcp_port"]))
attempt("ipv6_loopback", socket.AF_INET6, ("::1", data["tcp6_port"]))
attempt("abstract_unix", socket.AF_UNIX, b"\0" + data["abstract"].encode())
for path in data["unix_paths"]:
    attempt("unix:" + path, socket.AF_UNIX, path)
try:
    socket.getaddrinfo("localhost.localdomain.example", 80)
    res["dns"] = "ok"
except OSError as exc:
    res["dns"] = type(exc).__name__
fds = {}
for fd in os.listdir("/proc/self/fd"):
    try:
        fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        pass
res["fds"] = fds
(out / "seek.json").write_text(json.dumps(res))
"""


def _python_steps(folder: Path) -> set[str]:
    """Names in ``folder`` that lead to the Python environment the sandbox gets bound read-only."""
    steps = set()
    for p in (Path(sys.prefix), Path(os.path.realpath(sys.base_prefix))):
        if folder in p.parents:
            steps.add(p.relative_to(folder).parts[0])
    return steps


@pytest.fixture
def listeners() -> Iterator[dict[str, Any]]:
    """Host listeners the sandbox must not reach: a TCP port on 127.0.0.1, one on ::1, an abstract unix socket."""
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(4)
    tcp6 = socket.socket(socket.AF_INET6)
    tcp6.bind(("::1", 0))
    tcp6.listen(4)
    name = f"clawpipe-hostile-{os.getpid()}"
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(b"\0" + name.encode())
    abstract.listen(4)
    try:
        yield {"tcp_port": tcp.getsockname()[1], "tcp6_port": tcp6.getsockname()[1], "abstract": name}
    finally:
        for s in (tcp, tcp6, abstract):
            s.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.slow
def test_no_secret_of_the_host_and_no_other_address_reaches_a_sandbox(
    backend: str,
    tmp_path: Path,
    upstream: Upstream,
    echo: EchoTaskSet,
    home: Path,
    listeners: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for k, v in PLANTED.items():
        monkeypatch.setenv(k, v)
    admin = home / "admin_token"
    home.mkdir(parents=True, exist_ok=True)
    admin.write_text(PLANTED["CLAWPIPE_ADMIN_TOKEN"])
    ssh = Path.home() / ".ssh"
    reads = [str(admin), str(home), "/etc/shadow", "/root", str(ssh), str(Path.home())]
    unix_paths = ["/var/run/docker.sock", "/run/docker.sock"]
    if os.environ.get("DOCKER_HOST", "").startswith("unix://"):
        unix_paths.append(os.environ["DOCKER_HOST"][len("unix://") :])
    data = {"planted": list(PLANTED.values()), "reads": reads, "unix_paths": unix_paths, **listeners}
    m = load_manifest(make_harness(tmp_path, "seeker", SEEKER, env={"DECLARED": "yes"}))
    task = {**echo.generate(1)[0], "data": data}
    res = run_rollouts(
        [RolloutSpec(run_id="r", iteration=0, harness=m, task=task, model="tiny")],
        proxy_url=upstream.url,
        backend=backend,
        results_path=tmp_path / "results.jsonl",
        secret=PLANTED["CLAWPIPE_SECRET"].encode(),
        scratch_dir=tmp_path / "scratch",
        task_sets={"echo": echo},
        keep_workdirs=True,
    )
    assert res[0].status == "succeeded", res[0].stderr_tail
    seek = json.loads((Path(res[0].workdir) / "out" / "seek.json").read_text())
    assert seek["found"] == [], seek["found"]
    assert len(seek["pids"]) <= 8, seek["pids"]  # its own pid namespace: no host process to read
    for path, outcome in seek["reads"].items():
        if isinstance(outcome, list):  # a folder on the way to the Python install bound read-only: only that
            assert set(outcome) <= _python_steps(Path(path)), (path, outcome)
        else:
            assert outcome in ("FileNotFoundError", "PermissionError"), (path, outcome)
    for name, outcome in seek["connects"].items():
        assert outcome != "ok", (name, outcome)
    assert seek["dns"] == "gaierror"
    inherited = {fd: target for fd, target in seek["fds"].items() if int(fd) > 2 and "/proc/" not in target}
    assert inherited == {}, seek["fds"]  # no descriptor of the runner's (pipes, sockets, files) reached it


KNOCKER = r"""
import json, os, pathlib, urllib.error, urllib.request
port = os.environ["OPENAI_BASE_URL"].split("/")[2]
own = os.environ["OPENAI_API_KEY"]
codes = {}

def call(name, method, path, auth=None, body=b"{}"):
    headers = {"content-type": "application/json"}
    if auth:
        headers["authorization"] = auth
    req = urllib.request.Request(f"http://{port}{path}", data=body if method == "POST" else None,
                                 headers=headers, method=method)
    try:
        codes[name] = urllib.request.urlopen(req, timeout=10).status
    except urllib.error.HTTPError as exc:
        codes[name] = exc.code

chat = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
call("stats", "GET", "/admin/stats")
call("stats_own_key", "GET", "/admin/stats", "Bearer " + own)
call("pause_own_key", "POST", "/admin/pause", "Bearer " + own, b'{"wait_s": 0}')
call("pause_keyed_path", "POST", f"/r/{own}/admin/pause", "Bearer " + own, b'{"wait_s": 0}')
call("version", "POST", "/admin/policy_version", "Bearer " + own, b'{"policy_version": 99}')
call("unkeyed_chat", "POST", "/v1/chat/completions", None, chat)
call("made_up_key_chat", "POST", "/v1/chat/completions", "Bearer cp1.AAAA.BBBB", chat)
call("own_key_header_chat", "POST", "/v1/chat/completions", "Bearer " + own, chat)
call("own_chat", "POST", f"/r/{own}/v1/chat/completions", "Bearer " + own, chat)
pathlib.Path(os.environ["CLAWPIPE_OUTPUT"], "codes.json").write_text(json.dumps(codes))
"""


@pytest.mark.sandbox
def test_the_proxys_admin_endpoints_refuse_a_sandbox(tmp_path: Path, upstream: Upstream, echo: EchoTaskSet) -> None:
    from clawpipe.proxy import ProxyServer

    admin_token = os.urandom(16).hex()
    proxy = ProxyServer(
        upstreams=[upstream.url], capture_dir=tmp_path / "captures", secret=b"k", admin_token=admin_token, fsync=False
    )
    url = proxy.start()
    try:
        m = load_manifest(make_harness(tmp_path, "knocker", KNOCKER))
        res = run_rollouts(
            [RolloutSpec(run_id="r", iteration=0, harness=m, task=echo.generate(1)[0], model="m")],
            proxy_url=url,
            backend="bwrap",
            results_path=tmp_path / "results.jsonl",
            secret=b"k",
            scratch_dir=tmp_path / "scratch",
            task_sets={"echo": echo},
            keep_workdirs=True,
        )
        assert (proxy.paused, proxy.policy_version) == (False, 0)
    finally:
        proxy.stop()
    codes = json.loads((Path(res[0].workdir or "") / "out" / "codes.json").read_text())
    assert (codes.pop("own_chat"), codes.pop("own_key_header_chat")) == (200, 200)  # its own key, either place
    for name, code in codes.items():
        assert code in (401, 404), (name, code)
