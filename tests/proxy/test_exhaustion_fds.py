"""The capture proxy out of file descriptors: a real ``clawpipe proxy`` process under a low RLIMIT_NOFILE, more
client connections than it may hold, calls in flight (and under a low RLIMIT_FSIZE: segments stop growing).

Accept errors neither spin its event loop nor stop its server; a call that needs an upstream connection the
proxy cannot open is a 503 naming the limit (the upstream is not marked down for the proxy's own shortage);
the calls in flight finish and are captured once; once connections close it serves again.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from clawpipe.lake import land, run_sql
from tests.proxy.conftest import ADMIN, SECRET, key_for
from tests.support.net import read_all
from tests.support.upstream import ScriptedUpstream, say

ROOT = Path(__file__).resolve().parents[2]
FD_LIMIT = 96
IN_FLIGHT = 4


# A ProxyServer with its default caps (4,096 connections), which the descriptor limit cannot hold: what
# `clawpipe proxy` would be without fitting its caps, or an embedded proxy whose process spends descriptors
# elsewhere. Stops on SIGTERM.
_UNFITTED = """
import os, signal, sys, threading
from clawpipe.proxy import ProxyServer
proxy = ProxyServer(**kwargs)
url = proxy.start()
with open(ready + ".tmp", "w") as f:
    f.write(url)
os.replace(ready + ".tmp", ready)
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
stop.wait()
proxy.stop(drain_timeout_s=5)
"""


def start_proxy(
    upstream: str,
    capture_dir: Path,
    ready: Path,
    limit: str = "RLIMIT_NOFILE",
    value: int = FD_LIMIT,
    *,
    fitted: bool = True,
) -> subprocess.Popen[bytes]:
    """``clawpipe proxy`` (run_proxy: caps fitted to the descriptor limit), or a bare ProxyServer, under a limit."""
    kwargs = dict(upstreams=[upstream], capture_dir=str(capture_dir), secret=SECRET, admin_token=ADMIN, port=0)
    code = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.{limit}, ({value}, {value}))\n"
        f"kwargs, ready = {kwargs!r}, {str(ready)!r}\n"
    )
    if fitted:
        code += "from clawpipe.proxy.run import run_proxy\nrun_proxy(**kwargs, ready_file=ready)\n"
    else:
        code += _UNFITTED
    with open(ready.with_suffix(".log"), "wb") as log:  # its log, read when a check fails
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=log)
    deadline = time.monotonic() + 30
    while not ready.is_file():
        assert proc.poll() is None and time.monotonic() < deadline, "the proxy did not start"
        time.sleep(0.05)
    return proc


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raw_call(port: int, content: str) -> bytes:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()
    head = (
        f"POST /r/{key_for('rfd')}/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


@pytest.mark.slow
def _shut(socks: list[socket.socket], proc: subprocess.Popen[bytes], up: ScriptedUpstream) -> None:
    """Close the test's connections, stop the proxy (its last segment sealed) and the upstream."""
    for s in socks:
        s.close()
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    up.stop()


def test_a_proxy_out_of_descriptors_refuses_clearly_keeps_serving_and_captures_calls_once(tmp_path: Path) -> None:
    up = ScriptedUpstream(default=say("fine"), delay_s=3.0).start()
    cap = tmp_path / "cap"
    proc = start_proxy(up.url, cap, tmp_path / "ready", fitted=False)
    url = (tmp_path / "ready").read_text().strip()
    port = int(url.rsplit(":", 1)[1])
    idle: list[socket.socket] = []
    try:
        # calls in flight, each holding a client and an upstream connection for 3 s
        results: list[int] = []

        def one(i: int) -> None:
            r = httpx.post(
                f"{url}/r/{key_for('rfd')}/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": f"in flight {i}"}]},
                timeout=30,
            )
            results.append(r.status_code)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(IN_FLIGHT)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while len(up.model_requests()) < IN_FLIGHT:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # twice as many idle connections as the proxy may hold descriptors
        for _ in range(2 * FD_LIMIT):
            s = socket.create_connection(("127.0.0.1", port))
            s.settimeout(10)
            idle.append(s)
        time.sleep(0.3)
        used = len(os.listdir(f"/proc/{proc.pid}/fd"))
        assert used >= FD_LIMIT - 2  # the proxy is at its limit
        c0 = cpu_s(proc.pid)
        time.sleep(1.5)
        assert cpu_s(proc.pid) - c0 < 0.3  # no accept loop spinning at 100%

        # a call on a connection the proxy holds: its upstream connection cannot be opened -> a clear 503
        idle[0].sendall(raw_call(port, "no descriptor left"))
        answer = read_all(idle[0]).decode(errors="replace")
        assert answer.startswith("HTTP/1.1 503"), answer[:200]
        assert "Too many open files" in answer and f"{FD_LIMIT} open files (RLIMIT_NOFILE)" in answer
        # a body large enough to be read by the body checker's worker, which cannot be started: a clear 503 too
        big = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * (2 << 20)}]}).encode()
        head = raw_call(port, "")
        idle[1].sendall(
            head.split(b"content-length: ")[0] + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(big)
        )
        idle[1].sendall(big)
        answer = read_all(idle[1]).decode(errors="replace")
        assert answer.startswith("HTTP/1.1 503") and "could not start its body checker" in answer, answer[:300]
        assert "(RLIMIT_NOFILE)" in answer

        for t in threads:
            t.join(30)
        assert results == [200] * IN_FLIGHT  # the calls in flight finished
        for s in idle:
            s.close()
        idle.clear()
        time.sleep(0.3)
        up.delay_s = 0.0
        r = httpx.post(
            f"{url}/r/{key_for('rfd')}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "after"}]},
            timeout=30,
        )
        assert r.status_code == 200  # the server kept accepting: it serves again
        replicas = httpx.get(f"{url}/admin/replicas", headers={"authorization": f"Bearer {ADMIN}"}).json()
        (rep,) = replicas["replicas"]
        assert rep["state"] == "up" and rep["errors"] == 0  # the proxy's own shortage is not the upstream's
    finally:
        _shut(idle, proc, up)
    lake = tmp_path / "lake"
    land(cap, lake)
    rows = run_sql(lake, "select http_status, count(*) as n, count(distinct call_id) as d from model_calls group by 1")
    assert sorted((r["http_status"], r["n"], r["d"]) for r in rows.to_pylist()) == [
        (200, IN_FLIGHT + 1, IN_FLIGHT + 1),
        (503, 2, 2),
    ]


@pytest.mark.slow
def test_segments_at_the_file_size_limit_are_sealed_and_capture_goes_on_in_fresh_ones(tmp_path: Path) -> None:
    """Under RLIMIT_FSIZE smaller than a segment's size limit, a segment that cannot grow is sealed and the
    record goes to a fresh segment: no call is refused for it."""
    up = ScriptedUpstream(default=say("word " * 40)).start()
    cap = tmp_path / "cap"
    limit = 48 << 10
    proc = start_proxy(up.url, cap, tmp_path / "ready", "RLIMIT_FSIZE", limit)
    url = (tmp_path / "ready").read_text().strip()
    try:
        with httpx.Client(timeout=30) as client:
            for i in range(20):
                body = {"model": "m", "messages": [{"role": "user", "content": f"call {i}"}]}
                r = client.post(f"{url}/r/{key_for('rfsize')}/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        up.stop()
    segments = sorted(cap.glob("*.seg"))
    assert len(segments) >= 3 and all(p.stat().st_size <= limit for p in segments)
    lake = tmp_path / "lake"
    report = land(cap, lake)
    assert (report.calls, report.rejects) == (20, 0)


@pytest.mark.slow
def test_clawpipe_proxy_fits_its_connection_cap_to_its_descriptor_limit_and_answers_past_it(tmp_path: Path) -> None:
    """Under ``ulimit -n 96`` `clawpipe proxy` serves at most 16 client connections: the ones past that are
    answered with a 503 naming the cap (not closed unanswered), and admitted connections get their calls
    through (an upstream connection still opens)."""
    up = ScriptedUpstream(default=say("fine")).start()
    cap = tmp_path / "cap"
    proc = start_proxy(up.url, cap, tmp_path / "ready")
    url = (tmp_path / "ready").read_text().strip()
    port = int(url.rsplit(":", 1)[1])
    conns: list[socket.socket] = []
    try:
        for _ in range(40):
            s = socket.create_connection(("127.0.0.1", port))
            s.settimeout(10)
            conns.append(s)
            time.sleep(0.01)  # accepted in order: the first ones are admitted
        refused = []
        for s in conns[16:]:
            refused.append(read_all(s).decode(errors="replace"))
        assert len(refused) == 24 and all(r.startswith("HTTP/1.1 503") for r in refused), refused[:1]
        assert "limit of 16 open connections" in refused[0] and "ulimit -n" in refused[0]
        for i, s in enumerate(conns[:16]):
            s.sendall(raw_call(port, f"admitted {i}"))
        answers = [read_all(s).decode(errors="replace") for s in conns[:16]]
        assert all(a.startswith("HTTP/1.1 200") for a in answers), [a[:120] for a in answers if "200" not in a[:20]]
    finally:
        _shut(conns, proc, up)
    log = (tmp_path / "ready.log").read_text()
    assert "descriptor limit 96 holds fewer connections than asked: at most 16 client connections" in log
    lake = tmp_path / "lake"
    assert land(cap, lake).calls == 16
