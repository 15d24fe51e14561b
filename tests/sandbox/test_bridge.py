"""The bridge under abuse: a per-sandbox connection cap, idle connections closed, a flooding sandbox beside a
normal one (real bwrap, a real loopback upstream)."""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

import pytest

from clawpipe.errors import ConfigError
from clawpipe.sandbox import RolloutSpec, load_manifest, run_rollouts
from clawpipe.sandbox.bridge import Bridge, listen_on_host
from clawpipe.sandbox.limits import connection_cap
from clawpipe.sandbox.rollout import masked_groups
from tests.sandbox.support import EchoTaskSet, Sampler, Upstream, make_harness

SECRET = b"bridge-test-secret"

CALL = b"POST /r/k/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"


def _response(s: socket.socket) -> bytes:
    """One whole HTTP response (head and Content-Length body) from ``s``."""
    s.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")) if k.lower() == b"content-length"
    )
    while len(body) < length:
        body += s.recv(65536)
    return head


def _call(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(CALL)
        return _response(s)


def _closed_by_peer(s: socket.socket) -> bool:
    s.settimeout(5)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_connections_over_the_cap_are_refused_and_counted(upstream: Upstream) -> None:
    with Bridge(upstream.url, max_connections=2) as bridge:
        route = bridge.attach(listen_on_host())
        held = [socket.create_connection(("127.0.0.1", route.port)) for _ in range(2)]
        time.sleep(0.2)  # both accepted and forwarded
        extra = socket.create_connection(("127.0.0.1", route.port))
        assert _closed_by_peer(extra)  # reset by the bridge, not held open
        assert route.refused == 1 and route.open == 2
        held[0].close()
        deadline = time.monotonic() + 5
        while route.open > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _call(route.port).startswith(b"HTTP/1.1 200")  # a freed slot serves the next call
        assert route.peak_open == 2 and route.requests == 1
        for s in [*held, extra]:
            s.close()
        bridge.detach(route)


def test_idle_connections_are_closed(upstream: Upstream) -> None:
    with Bridge(upstream.url, idle_timeout_s=0.3) as bridge:
        route = bridge.attach(listen_on_host())
        idle = socket.create_connection(("127.0.0.1", route.port))
        busy = socket.create_connection(("127.0.0.1", route.port))
        t0 = time.monotonic()
        for _ in range(6):  # a keep-alive connection that keeps calling stays open
            busy.sendall(CALL)
            assert _response(busy).startswith(b"HTTP/1.1 200")
            time.sleep(0.1)
        assert _closed_by_peer(idle)
        assert 0.3 <= time.monotonic() - t0 < 3.0
        assert route.idle_closed == 1 and route.open == 1
        idle.close()
        busy.close()
        bridge.detach(route)


def test_connection_cap_fits_the_descriptor_limit() -> None:
    assert connection_cap(8, 64, 20000) == 64
    assert connection_cap(64, 64, 4096) == (4096 - 256) // 64 // 2 - 8  # an equal share for every sandbox
    with pytest.raises(ConfigError, match="lower the concurrency or raise `ulimit -n`"):
        connection_cap(512, 64, 4096)


FLOOD = """
import os, socket, time
port = int(os.environ["OPENAI_BASE_URL"].split(":")[2].split("/")[0])
socks = []
for _ in range(3000):  # non-blocking connects: thousands of idle connections in a moment
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex(("127.0.0.1", port))
    socks.append(s)
time.sleep(5)
"""

NEIGHBOUR = """
import json, os, time, urllib.request
time.sleep(1.0)  # the flood is under way
ok = 0
for _ in range(20):
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "m", "messages": []}).encode(),
        headers={"content-type": "application/json", "authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    reply = json.loads(urllib.request.urlopen(req, timeout=10).read())
    ok += 1
    time.sleep(0.1)
open(os.path.join(os.environ["CLAWPIPE_OUTPUT"], "answer.txt"), "w").write(reply["choices"][0]["message"]["content"])
print(ok)
"""


# What a policy's code can do wherever it runs in the sandbox (e.g. a fixit solution.py imported by check.py):
# flood the bridge, then leave a wrong answer.
FLOOD_THEN_WRONG = """
import os, socket, time
port = int(os.environ["OPENAI_BASE_URL"].split(":")[2].split("/")[0])
socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
extra = []
for _ in range(20):
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex(("127.0.0.1", port))
    extra.append(s)
time.sleep(0.5)
open(os.path.join(os.environ["CLAWPIPE_OUTPUT"], "answer.txt"), "w").write("41")
"""


@pytest.mark.sandbox
def test_a_sandbox_that_floods_its_bridge_is_scored_and_masks_no_group(
    tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    """Refused connections are the sandbox's own doing: were they an infra error, code that knows it is wrong
    could flood to have its whole GRPO group left out of training instead of scored."""
    flood = load_manifest(make_harness(tmp_path / "h", "flood", FLOOD_THEN_WRONG))
    task = echo.generate(1)[0]
    res = run_rollouts(
        [RolloutSpec(run_id="flood", iteration=0, harness=flood, task=task, model="m", group_id="g")],
        proxy_url=upstream.url,
        backend="bwrap",
        results_path=tmp_path / "results.jsonl",
        secret=SECRET,
        scratch_dir=tmp_path / "scratch",
        task_sets={"echo": echo},
        bridge_max_connections=4,
    )
    assert (res[0].status, res[0].reward) == ("failed", 0.0), res[0].error
    assert re.search(r"refused \d+ connections over the sandbox's cap of 4", res[0].error or ""), res[0].error
    assert masked_groups(res) == set()


class FdSampler(Sampler):
    """The highest number of descriptors this process (runner, bridge and upstream) held while running."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0

    def sample(self) -> None:
        self.peak = max(self.peak, len(os.listdir("/proc/self/fd")))


@pytest.mark.sandbox
@pytest.mark.slow
def test_a_flooding_sandbox_does_not_starve_its_neighbour(tmp_path: Path, echo: EchoTaskSet) -> None:
    up = Upstream()
    try:
        flood = load_manifest(make_harness(tmp_path / "h", "flood", FLOOD))
        normal = load_manifest(make_harness(tmp_path / "h", "normal", NEIGHBOUR))
        task = echo.generate(1)[0]
        specs = [
            RolloutSpec(run_id="flood", iteration=0, harness=m, task=task, model="m", sample_idx=i)
            for i, m in enumerate([flood, normal])
        ]
        cap = 32
        with FdSampler() as fds:
            res = run_rollouts(
                specs,
                proxy_url=up.url,
                backend="bwrap",
                concurrency=2,
                results_path=tmp_path / "results.jsonl",
                secret=SECRET,
                scratch_dir=tmp_path / "scratch",
                task_sets={"echo": echo},
                bridge_max_connections=cap,
            )
        flooder, neighbour = res
        # The neighbour got every call through while the flood held its bridge at the cap.
        assert (neighbour.status, neighbour.n_calls, neighbour.reward) == ("succeeded", 20, 1.0), neighbour.stderr_tail
        assert (flooder.status, flooder.reward, flooder.attempt) == ("failed", 0.0, 1)
        refused = re.search(
            rf"refused (\d+) connections over the sandbox's cap of {cap} open at once", flooder.error or ""
        )
        assert refused and int(refused.group(1)) > 0, flooder.error
        print(f"neighbour: {neighbour.n_calls}/20 calls; flooder: {refused.group(0)}; runner fds peak {fds.peak}")
        # Per sandbox the runner process held at most ~3 descriptors per capped connection (the bridge's two and
        # the in-process upstream's one), not one per flooding socket.
        assert fds.peak < 200 + 3 * 2 * cap, fds.peak
    finally:
        up.close()
