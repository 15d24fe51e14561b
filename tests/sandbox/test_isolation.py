"""Rollouts in real sandboxes (bwrap and docker): the proxy works through the bridge, and nothing else does."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from clawpipe.keys import mint_key, verify_key
from clawpipe.sandbox import RolloutSpec, load_manifest, run_rollouts
from clawpipe.sandbox.uids import UidPool
from tests.sandbox.support import CHAT_HARNESS, EchoTaskSet, Upstream, make_harness, procs_with

BACKENDS = [pytest.param("bwrap", marks=pytest.mark.sandbox), pytest.param("docker", marks=pytest.mark.docker)]

SECRET = b"bwrap-test-secret"

PROBE = r"""
import json, os, socket, pathlib, urllib.request
out = pathlib.Path(os.environ["CLAWPIPE_OUTPUT"])
data = json.loads(pathlib.Path(os.environ["CLAWPIPE_TASK"]).read_text())["data"]
res = {}

def attempt(name, fn):
    try:
        fn()
        res[name] = "ok"
    except Exception as exc:
        res[name] = f"{type(exc).__name__}: {exc}"

def connect(host, port):
    s = socket.create_connection((host, port), timeout=2)
    s.close()

base = os.environ["OPENAI_BASE_URL"]
auth = {"content-type": "application/json", "authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}
request = urllib.request.Request(base + "/chat/completions", data=b'{"model":"m","messages":[]}', headers=auth)
attempt("proxy", lambda: urllib.request.urlopen(request, timeout=5).read())
attempt("host_port_upstream", lambda: connect("127.0.0.1", data["upstream_port"]))
attempt("host_port_other", lambda: connect("127.0.0.1", data["other_port"]))
attempt("other_address", lambda: connect(data["host_ip"], data["other_port"]))
attempt("internet", lambda: connect("1.1.1.1", 443))
attempt("dns", lambda: socket.getaddrinfo("example.com", 80))
attempt("ipv6_lo", lambda: connect("::1", data["other_port"]))
for name, path in data["reads"].items():
    attempt("read_" + name, lambda p=path: (os.listdir(p) if os.path.isdir(p) else open(p).read()))
for name, path in data["writes"].items():
    attempt("write_" + name, lambda p=path: open(p, "w").write("x"))
attempt("read_tool", lambda: open(data["tool_file"]).read())
attempt("write_tool", lambda: open(data["tool_file"], "w").write("x"))
attempt("write_tmp", lambda: open("/tmp/scratch", "w").write("x"))  # private tmpfs
attempt("write_shm", lambda: open("/dev/shm/scratch", "w").write("x"))
attempt("write_workdir", lambda: open(os.path.join(os.environ["CLAWPIPE_WORKDIR"], "mine.txt"), "w").write("x"))
res["uid"] = [os.getuid(), os.geteuid(), os.getgid(), os.getgroups()]
res["caps"] = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")]
res["env"] = dict(os.environ)
res["root_listing"] = sorted(os.listdir("/"))
(out / "probe.json").write_text(json.dumps(res))
"""


def sandbox_run(specs: list[RolloutSpec], up: Upstream, tmp: Path, echo: EchoTaskSet, **kw: Any) -> list[Any]:
    opts: dict[str, Any] = {
        "concurrency": 4,
        "results_path": tmp / "results.jsonl",
        "secret": SECRET,
        "scratch_dir": tmp / "scratch",
        "task_sets": {"echo": echo},
        "keep_workdirs": True,
    }
    opts.update(kw)
    return run_rollouts(specs, **{"proxy_url": up.url, **opts})


def in_uid_range(uid: int) -> bool:
    pool = UidPool.from_settings()
    return pool.base <= uid < pool.base + pool.count


def _host_ip() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outward interface
            return s.getsockname()[0]
        except OSError:
            return "10.0.2.15"


@pytest.mark.parametrize("backend", BACKENDS)
def test_chat_harness_reaches_the_proxy_through_the_bridge(
    backend: str, tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    m = load_manifest(make_harness(tmp_path, "chat", CHAT_HARNESS))
    before = len(upstream.calls)
    res = sandbox_run(
        [RolloutSpec(run_id="r", iteration=0, harness=m, task=echo.generate(1)[0], model="tiny")],
        upstream,
        tmp_path,
        echo,
        backend=backend,
    )
    assert (res[0].status, res[0].reward, res[0].n_calls, res[0].backend) == ("succeeded", 1.0, 1, backend)
    call = upstream.calls[before]
    assert call["body"]["model"] == "tiny"
    assert verify_key(SECRET, call["path"].split("/")[2]).rollout_id == res[0].rollout_id
    work = Path(res[0].workdir)
    owner = (work / "out" / "answer.txt").stat().st_uid  # written as the sandbox's own uid from the clawpipe range
    assert in_uid_range(owner) and owner != os.geteuid(), owner
    assert (work / "start.txt").read_text() == "starting file\n"  # the task set's starting file was there


def _a_home_entry() -> str:
    """Some entry of the host user's home that is not part of the Python install bound into sandboxes."""
    for entry in sorted(Path.home().iterdir()):
        if not str(Path(sys.base_prefix).resolve()).startswith(str(entry)) and not sys.prefix.startswith(str(entry)):
            return str(entry)
    return str(Path.home() / ".bashrc")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.slow
def test_isolation_from_inside(backend: str, tmp_path: Path, upstream: Upstream, echo: EchoTaskSet, home: Path) -> None:
    from clawpipe.config import get_settings

    captures = get_settings().captures_dir
    captures.mkdir(parents=True)
    (captures / "seg-1.seg").write_text("captured calls")
    secret_file = home / "secret"
    secret_file.write_text("s3cret")
    other = socket.socket()
    other.bind(("0.0.0.0", 0))
    other.listen(8)
    other_port = other.getsockname()[1]
    tool = Path(tempfile.mkdtemp(prefix="tool-", dir=tmp_path.parent))  # a [sandbox] ro_paths entry
    (tool / "file.txt").write_text("tool data")
    tool.chmod(0o755)  # the sandbox user must be able to read what it is given
    probe_dir = make_harness(tmp_path, "probe", PROBE, env={"DECLARED": "yes"})
    with open(probe_dir / "harness.toml", "a") as f:
        f.write(f"[sandbox]\nro_paths = [{str(tool)!r}]\n")
    probe = load_manifest(probe_dir)
    sleeper = load_manifest(make_harness(tmp_path, "sleeper", "import time\ntime.sleep(20)\n"))
    tasks = echo.generate(2)
    scratch = tmp_path / "scratch"
    neighbour_work = scratch / "r" / "iter-0" / f"{tasks[1]['task_id']}.0" / "work"
    data = {
        "upstream_port": int(upstream.url.rsplit(":", 1)[1]),
        "other_port": other_port,
        "host_ip": _host_ip(),
        "tool_file": str(tool / "file.txt"),
        "reads": {
            "home": _a_home_entry(),
            "shadow": "/etc/shadow",
            "captures": str(captures / "seg-1.seg"),
            "secret": str(secret_file),
            "neighbour": str(neighbour_work / "start.txt"),
            "host_tmp": str(tmp_path),
        },
        "writes": {
            "usr": "/usr/x",
            "harness": "/harness/x",
            "task": "/task.json",
            "etc": "/etc/x",
            "root": "/x",
            "venv": os.path.join(os.path.dirname(os.path.dirname(os.__file__)), "x"),
        },
    }
    specs = [
        RolloutSpec(run_id="r", iteration=0, harness=probe, task={**tasks[0], "data": data}, model="tiny"),
        RolloutSpec(run_id="r", iteration=0, harness=sleeper, task=tasks[1], model="tiny"),  # the neighbour
    ]
    try:
        res = sandbox_run(specs, upstream, tmp_path, echo, timeout_s=4, backend=backend)
    finally:
        other.close()
        shutil.rmtree(tool)
    assert res[0].status == "succeeded", res[0].stderr_tail
    p = json.loads((Path(res[0].workdir) / "out" / "probe.json").read_text())
    assert p["proxy"] == "ok"
    for name in ("host_port_upstream", "host_port_other"):  # host ports do not exist in the sandbox's netns
        assert "ConnectionRefused" in p[name], (name, p[name])
    for name in ("other_address", "internet", "ipv6_lo"):
        assert p[name].startswith(("OSError", "ConnectionRefusedError")), (name, p[name])
    assert "gaierror" in p["dns"]
    for name in data["reads"]:
        assert p["read_" + name].startswith(("FileNotFoundError", "PermissionError")), (name, p["read_" + name])
    for name in data["writes"]:
        assert p["write_" + name].startswith(("OSError: [Errno 30]", "PermissionError", "FileNotFoundError")), (
            name,
            p["write_" + name],
        )
    assert p["write_workdir"] == p["write_tmp"] == p["write_shm"] == "ok"
    assert p["read_tool"] == "ok" and p["write_tool"].startswith("OSError: [Errno 30]")
    uid = p["uid"][0]  # a uid of the sandbox's own from the clawpipe range, its gid the same number
    assert in_uid_range(uid) and p["uid"][:3] == [uid, uid, uid] and p["uid"][3] in ([], [uid]), p["uid"]
    assert p["caps"] == ["0000000000000000"]
    key = p["env"]["OPENAI_API_KEY"]
    assert set(p["env"]) == {
        "OPENAI_BASE_URL",
        "OPENAI_API_BASE",
        "OPENAI_API_KEY",
        "ANTHROPIC_BASE_URL",
        "ANTHROPIC_API_KEY",
        "CLAWPIPE_MODEL",
        "OPENAI_MODEL",
        "ANTHROPIC_MODEL",
        "CLAWPIPE_TASK",
        "CLAWPIPE_WORKDIR",
        "CLAWPIPE_OUTPUT",
        "HOME",
        "TMPDIR",
        "PATH",
        "LANG",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONUNBUFFERED",
        "DECLARED",
        "CLAWPIPE_TIMEOUT_S",
        *(["HOSTNAME", "PWD"] if backend == "docker" else ["PWD"]),  # docker: its sh launcher sets PWD too
    }
    assert p["env"]["DECLARED"] == "yes" and p["env"]["ANTHROPIC_API_KEY"] == key
    assert p["env"]["OPENAI_API_BASE"] == p["env"]["OPENAI_BASE_URL"]
    # The only key the harness holds is its own; minting another rollout's key needs the host's secret.
    assert verify_key(SECRET, key).rollout_id == res[0].rollout_id
    assert key != mint_key(SECRET, run_id="r", iteration=0, rollout_id=res[1].rollout_id)
    assert not any(SECRET.decode() in v for v in p["env"].values())
    python_tops = {Path(x).parts[1] for x in (sys.prefix, os.path.realpath(sys.base_prefix))}
    system_tops = {t for t in ("bin", "sbin", "lib", "lib32", "lib64", "libx32") if Path("/", t).exists()}
    fixed = {"dev", "etc", "harness", "proc", "task.json", "tmp", "usr", "workdir"}
    if backend == "bwrap":
        assert set(p["root_listing"]) == fixed | system_tops | python_tops
    else:  # the imported image's skeleton
        assert set(p["root_listing"]) == fixed | system_tops | python_tops | {".dockerenv", "root", "run", "sys"}
    assert res[1].status == "timeout"


BOMB = r"""
import os, pathlib, time
out = pathlib.Path(os.environ["CLAWPIPE_OUTPUT"])
n = 0
try:
    while n < 1000:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError as exc:
    (out / "forks.txt").write_text(f"{n} {exc.errno}")
while True:  # now a real fork bomb
    try:
        os.fork()
    except OSError:
        pass
"""

HOG = r"""
chunks = []
for _ in range(200):
    chunks.append(b"x" * (16 << 20))
"""

DAEMON = r"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execvp("sleep", ["sleep", sys.argv[1]])
    os._exit(0)
time.sleep(60)
"""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.slow
def test_limits_fork_bomb_oom_and_timeout_kill_the_tree(
    backend: str, tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    marker = f"777.{os.getpid()}{int(time.time()) % 1000}"
    bomb = load_manifest(make_harness(tmp_path, "bomb", BOMB, timeout_s=3, resources={"pids": 32}))
    hog = load_manifest(make_harness(tmp_path, "hog", HOG, resources={"memory_mb": 96}))
    d = make_harness(tmp_path, "daemon", DAEMON, timeout_s=2)
    (d / "harness.toml").write_text((d / "harness.toml").read_text().replace('"main.py"]', f'"main.py", "{marker}"]'))
    daemon = load_manifest(d)
    tasks = echo.generate(3)
    specs = [
        RolloutSpec(run_id="lim", iteration=0, harness=h, task=tasks[i], model="m")
        for i, h in enumerate((bomb, hog, daemon))
    ]
    t0 = time.monotonic()
    res = sandbox_run(specs, upstream, tmp_path, echo, backend=backend)
    assert time.monotonic() - t0 < 40
    assert [r.status for r in res] == ["timeout", "oom", "timeout"], [r.stderr_tail[-300:] for r in res]
    forks, errno = (Path(res[0].workdir) / "out" / "forks.txt").read_text().split()
    assert int(forks) < 32 and int(errno) == 11  # EAGAIN from the pids limit
    assert procs_with(marker) == []  # the daemonised sleeper died with its sandbox
    if backend == "docker":
        import docker

        client = docker.from_env()
        # all removed: the engine may still be finishing the removal of a container whose start it failed
        # under load ("cannot start a stopped process", which the runner retries), so it is given a moment
        deadline = time.monotonic() + 15
        while (left := client.containers.list(all=True, filters={"label": "clawpipe.sandbox"})) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.2)
        assert left == [], [(c.name, c.status) for c in left]
        client.close()


FORGER = r"""
import base64, json, os, pathlib, urllib.error, urllib.request
port = os.environ["OPENAI_BASE_URL"].split("/")[2]
own = os.environ["OPENAI_API_KEY"]
prefix, payload, mac = own.split(".")
run_id, iteration, _ = base64.urlsafe_b64decode(payload + "==").decode().split("\x1f")
victim = base64.urlsafe_b64encode(f"{run_id}\x1f{iteration}\x1fvictim.0".encode()).rstrip(b"=").decode()
keys = {"own": own, "forged": f"{prefix}.{victim}.{mac}", "made_up": "cp1.AAAA.BBBB"}
codes = {}
for name, key in keys.items():
    req = urllib.request.Request(f"http://{port}/r/{key}/v1/chat/completions",
        data=b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}',
        headers={"content-type": "application/json", "authorization": "Bearer " + key})
    try:
        codes[name] = urllib.request.urlopen(req, timeout=10).status
    except urllib.error.HTTPError as exc:
        codes[name] = exc.code
pathlib.Path(os.environ["CLAWPIPE_OUTPUT"], "codes.json").write_text(json.dumps(codes))
"""


@pytest.mark.sandbox
def test_a_harness_cannot_forge_another_rollouts_key(tmp_path: Path, upstream: Upstream, echo: EchoTaskSet) -> None:
    from clawpipe import capture
    from clawpipe.proxy import ProxyServer

    proxy = ProxyServer(
        upstreams=[upstream.url], capture_dir=tmp_path / "captures", secret=SECRET, admin_token="a", fsync=False
    )
    url = proxy.start()
    try:
        m = load_manifest(make_harness(tmp_path, "forger", FORGER))
        spec = RolloutSpec(run_id="r", iteration=0, harness=m, task=echo.generate(1)[0], model="m")
        res = sandbox_run([spec], upstream, tmp_path, echo, backend="bwrap", proxy_url=url)
    finally:
        proxy.stop()
    codes = json.loads((Path(res[0].workdir) / "out" / "codes.json").read_text())
    assert codes == {"own": 200, "forged": 401, "made_up": 401}
    records = [r for seg in sorted((tmp_path / "captures").glob("*.seg")) for r in capture.read_segment(seg)]
    assert [r.header["rollout_id"] for r in records] == [res[0].rollout_id]  # nothing attributed to "victim"
