"""Proxy overhead: CPU per call, throughput, added latency and RSS of clawpipe's capture proxy vs a peer.

Run: ``.venv/bin/python bench/proxy_overhead.py [--rss-calls 100000] [--no-peer]`` (default RSS check: 30k calls)

In one run it measures the mock upstream alone, clawpipe's proxy (durable capture on: group-committed,
fsynced segments) and, when it can be started, a peer's gateway (Agent Lightning 1.0.2 via
``$CLAWPIPE_SHARED_BENCH/peer_gateway.sh``, Python 3.12 in its own venv), each in front of the same
vLLM-style mock upstream (``bench/upstream.py``) and driven by the same closed-loop load generator
(:func:`loadgen_child`, run as a child of this script). CPU per call is the proxy process tree's
utime+stime (psutil) over the measured calls only, divided by their number: the load generator warms its
connections up first and waits, so warm-up CPU is in neither the numerator nor the denominator. The proxy
is pinned to core 1, upstream + load generator to core 0. Every call is its own production-shaped call
from bench/data.py: the load generator sends each measured call its own request (multi-turn chats; small:
p50 1.3 KB, large p50 62 KB) and the upstream answers with responses drawn from the same generator (small
p50 8.3 KB, large 163 KB; ids, logprobs, texts and tool calls all varied, ~1% upstream 500s, counted as
``non_200``). Request-body rows: the proxy's CPU per MB of request body for bodies of 1 KB to 24 MB, sent
with Content-Length and chunked (64 KB chunks). The machine's load average is printed next to
the figures (they mean little on a busy machine). The proxy defers parsing to landing, so the end-to-end
figure is proxy + landing CPU per call (landing measured on bench/data.py calls of the same kind, in a
child), against the peer's CPU per call. Prints human lines, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from clawpipe.net import free_port

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from upstream import body_framing  # noqa: E402  (bench/upstream.py: the mock upstream beside this bench)

SHARED = Path(os.environ.get("CLAWPIPE_SHARED_BENCH", ROOT.parent / "shared" / "bench"))
PY = sys.executable
SECRET = b"bench-secret"
CASES = [("small", 1, 2000), ("small", 32, 4000), ("large", 1, 300), ("large", 32, 600)]


def pin(core: int | None) -> list[str]:
    return ["taskset", "-c", str(core)] if core is not None and shutil.which("taskset") else []


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout} s")


def tree_cpu(pid: int) -> float:
    """utime+stime seconds of a process and its descendants."""
    p = psutil.Process(pid)
    total = 0.0
    for proc in [p, *p.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def tree_rss(pid: int) -> int:
    p = psutil.Process(pid)
    return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)])


def _load() -> list[float]:
    return [round(x, 1) for x in os.getloadavg()]


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.2f}/{five:.2f}"


def _requests(size: str, n: int, seed: int) -> list[bytes]:
    """``n`` HTTP requests whose bodies are bench/data.py's ``size`` calls (multi-turn chats, each its own)."""
    import data

    out = []
    for _, body, _ in data.calls(n, data.shape(size), seed=seed):
        head = b"POST %b HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        out.append(head % (PATH_MARK, len(body)) + body)
    return out


PATH_MARK = b"{path}"


async def _one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: bytes) -> int:
    writer.write(req)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    clen, chunked = body_framing(head)
    if chunked:
        while n := int((await reader.readuntil(b"\r\n")).strip(), 16):
            await reader.readexactly(n + 2)
        await reader.readexactly(2)
    elif clen:
        await reader.readexactly(clen)
    return status


def loadgen_child(path: str, port: int, conc: int, total: int, size: str, warm: int) -> None:
    """Closed-loop keep-alive load: ``conc`` connections warm up (``warm`` calls between them), then the
    child prints ``warm`` and waits for a line on stdin before the ``total`` measured calls; prints JSON.
    Every call sends its own request from bench/data.py (drawn before the warm-up)."""
    n_warm = max(1, warm // conc) * conc
    reqs = [
        r.replace(PATH_MARK, path.encode(), 1) for r in _requests(size, n_warm + total, seed=conc * 100_003 + total)
    ]
    lat: list[float] = []
    non_200 = [0]

    async def main() -> float:
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(conc)]
        k = 0
        for r, w in conns:
            for _ in range(n_warm // conc):
                await _one(r, w, reqs[k])
                k += 1
        print("warm", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        left = [total]

        async def worker(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while left[0] > 0:
                left[0] -= 1
                req = reqs[n_warm + left[0]]
                t = time.perf_counter()
                if await _one(r, w, req) != 200:  # bench/data.py draws ~1% upstream 500s
                    non_200[0] += 1
                lat.append((time.perf_counter() - t) * 1000)
            w.close()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(r, w) for r, w in conns))
        return time.perf_counter() - t0

    elapsed = asyncio.run(main())
    s = sorted(lat)
    out = {
        "n": len(s),
        "median_ms": round(statistics.median(s), 3),
        "p99_ms": round(s[max(0, int(0.99 * len(s)) - 1)], 3),
        "calls_per_s": round(len(s) / elapsed, 1),
        "non_200": non_200[0],
    }
    print(json.dumps(out), flush=True)


def loadgen(
    path: str, port: int, conc: int, n: int, size: str, core: int | None, pid: int | None = None
) -> tuple[dict[str, Any], float]:
    """Run the load generator; returns its figures and the CPU seconds of process ``pid`` (and children)
    over the measured calls only."""
    cmd = [*pin(core), PY, __file__, "--loadgen-child", path, str(port), str(conc), str(n), size, "100"]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        if child.stdout.readline().strip() != "warm":
            raise RuntimeError("load generator failed during warm-up")
        before = tree_cpu(pid) if pid else 0.0
        child.stdin.write("go\n")
        child.stdin.flush()
        result = child.stdout.readline()
        after = tree_cpu(pid) if pid else 0.0
        child.wait(60)
    finally:
        if child.poll() is None:
            child.kill()
    if child.returncode != 0 or not result:
        raise RuntimeError(f"load generator exited with {child.returncode}")
    return json.loads(result), after - before


def measure(name: str, pid: int | None, path: str, port: int, core0: int | None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for size, conc, n in CASES:
        lg, cpu = loadgen(path, port, conc, n, size, core0, pid)
        row = {
            "cpu_ms_per_call": round(cpu * 1000 / lg["n"], 4) if pid else None,
            "median_ms": lg["median_ms"],
            "p99_ms": lg["p99_ms"],
            "calls_per_s": lg["calls_per_s"],
            "non_200": lg["non_200"],
        }
        results[f"{size}_{conc}"] = row
        print(f"{name:9s} {size:5s} x{conc:<2d} {row} load {load()}", flush=True)
    return results


BODY_SIZES = [(1 << 10, 400), (64 << 10, 200), (1 << 20, 30), (24 << 20, 4)]
SEND_PIECE = 64 << 10


def _body_of(size: int) -> bytes:
    """A chat request whose JSON body is ``size`` bytes (the filler is the user's message)."""
    shell = json.dumps({"model": "mock-model", "messages": [{"role": "user", "content": ""}]}).encode()
    return shell.replace(b'"content": ""', b'"content": "' + b"x" * (size - len(shell)) + b'"')


def _send_body(sock: socket.socket, path: str, body: bytes, chunked: bool) -> None:
    head = f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    if not chunked:
        sock.sendall(head.encode() + b"content-length: %d\r\n\r\n" % len(body) + body)
        return
    sock.sendall(head.encode() + b"transfer-encoding: chunked\r\n\r\n")
    view = memoryview(body)
    for i in range(0, len(body), SEND_PIECE):  # one write per chunk, as streaming clients send them
        piece = view[i : i + SEND_PIECE]
        sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
    sock.sendall(b"0\r\n\r\n")


def _read_response(sock: socket.socket) -> None:
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(65536)
    head, _, rest = buf.partition(b"\r\n\r\n")
    # bench/upstream.py answers ~1% of calls with a drawn upstream 500, which the proxy passes on
    if not head.startswith((b"HTTP/1.1 200", b"HTTP/1.1 500")):
        raise RuntimeError(f"unexpected response: {head[:200]!r}")
    clen = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(rest) < clen:
        rest += sock.recv(1 << 20)


def request_bodies(pid: int, path: str, port: int) -> dict[str, Any]:
    """The proxy's CPU ms per MB of request body, by body size, with Content-Length and chunked."""
    rows: dict[str, Any] = {}
    for size, n in BODY_SIZES:
        body = _body_of(size)
        for chunked in (False, True):
            with socket.create_connection(("127.0.0.1", port)) as sock:
                _send_body(sock, path, body, chunked)  # warm-up call, not measured
                _read_response(sock)
                before = tree_cpu(pid)
                for _ in range(n):
                    _send_body(sock, path, body, chunked)
                    _read_response(sock)
                cpu = tree_cpu(pid) - before
            key = f"{size >> 10}KB_{'chunked' if chunked else 'length'}"
            rows[key] = round(cpu * 1000 / (n * size / 2**20), 2)
        kb = size >> 10
        print(
            f"clawpipe  request body {kb:>6d} KB: CPU ms/MB length {rows[f'{kb}KB_length']:8.2f}"
            f"  chunked {rows[f'{kb}KB_chunked']:8.2f}  load {load()}",
            flush=True,
        )
    return rows


def start_clawpipe(up_port: int, capture_dir: Path, core: int | None) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    code = (
        "import logging; logging.basicConfig(level=logging.WARNING)\n"
        "from clawpipe.proxy import run_proxy\n"
        f"run_proxy(upstreams=['http://127.0.0.1:{up_port}'], port={port}, capture_dir={str(capture_dir)!r},"
        f" secret={SECRET!r}, admin_token='bench')\n"
    )
    proc = subprocess.Popen([*pin(core), PY, "-c", code], cwd=ROOT)
    wait_port(port)
    return proc, port


def start_peer(up_port: int, core: int | None) -> tuple[int, int, str]:
    script = SHARED / "peer_gateway.sh"
    if not script.exists():
        raise RuntimeError(f"{script} not found")
    port = free_port()
    out = subprocess.run(
        ["bash", str(script), str(up_port), str(port)], capture_output=True, text=True, timeout=900, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"peer_gateway.sh failed ({out.returncode}): {out.stderr.strip()[-300:]}")
    pid_s, route = out.stdout.strip().splitlines()[-2:]
    pid = int(pid_s)
    if core is not None and shutil.which("taskset"):
        for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
            subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(proc.pid)], capture_output=True, check=False)
    return pid, port, route


def kill_tree(pid: int) -> None:
    try:
        p = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = [p, *p.children(recursive=True)]
    for q in procs:
        try:
            q.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    for q in alive:
        q.kill()


def rss_run(pid: int, path: str, port: int, total: int, core0: int | None) -> dict[str, Any]:
    """``total`` calls, 9 small : 1 large, in rounds at 32 clients; RSS of the proxy after each round."""
    start = tree_rss(pid)
    done, samples = 0, []
    t0 = time.monotonic()
    while done < total:
        n = min(10000, total - done)
        n_large = max(1, n // 10)
        loadgen(path, port, 32, n - n_large, "small", core0)
        loadgen(path, port, 32, n_large, "large", core0)
        done += n
        samples.append(tree_rss(pid))
    return {
        "calls": done,
        "rss_mb_start": round(start / 2**20, 1),
        "rss_mb_after": round(samples[-1] / 2**20, 1),
        "rss_mb_max": round(max(samples) / 2**20, 1),
        "seconds": round(time.monotonic() - t0, 1),
    }


def landing_cpu_ms(kind: str, n: int, tmp: Path) -> float:
    """Landing's CPU per call (one core, in a child) on ``n`` production-shaped calls of ``kind`` from
    bench/data.py: the parse the proxy defers, paid once per call at landing."""
    import data

    caps, lake = tmp / f"land-{kind}", tmp / f"lake-{kind}"
    data.write_segments(caps, n, data.shape(kind), per_segment=500)
    out = subprocess.run(
        [PY, str(ROOT / "bench" / "lake_throughput.py"), "--child-land", str(caps), str(lake)],
        check=True,
        capture_output=True,
        text=True,
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    shutil.rmtree(caps, ignore_errors=True)
    shutil.rmtree(lake, ignore_errors=True)
    return r["cpu_s"] * 1000 / max(1, r["calls"])


def ratio(peer: dict[str, Any] | None, ours: dict[str, Any], case: str) -> float | None:
    if not peer or not peer.get(case) or not ours[case]["cpu_ms_per_call"]:
        return None
    return round(peer[case]["cpu_ms_per_call"] / ours[case]["cpu_ms_per_call"], 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--rss-calls", type=int, default=30000, help="captured calls (9 small : 1 large) before RSS; 100000: full check"
    )
    ap.add_argument("--no-peer", action="store_true", help="skip the peer gateway")
    ap.add_argument("--no-bodies", action="store_true", help="skip the request-body rows")
    ap.add_argument("--loadgen-child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.loadgen_child:
        path, port, conc, total, size, warm = args.loadgen_child
        loadgen_child(path, int(port), int(conc), int(total), size, int(warm))
        return
    from clawpipe.keys import mint_key

    two_cores = (os.cpu_count() or 1) >= 2
    core0, core1 = (0, 1) if two_cores else (None, None)
    tmp = Path(tempfile.mkdtemp(prefix="clawpipe-bench-"))
    up_port = free_port()
    upstream = subprocess.Popen(
        [*pin(core0), PY, str(ROOT / "bench" / "upstream.py"), str(up_port)], stdout=subprocess.DEVNULL
    )
    procs: list[int] = [upstream.pid]
    report: dict[str, Any] = {"pinned": two_cores, "durable_capture": True, "loadavg_start": _load()}
    try:
        wait_port(up_port)
        alone = measure("upstream", None, "/v1/chat/completions", up_port, core0)
        report["upstream_alone"] = alone

        proxy, port = start_clawpipe(up_port, tmp / "captures", core1)
        procs.append(proxy.pid)
        key = mint_key(SECRET, run_id="bench", iteration=0, rollout_id="r1")
        path = f"/r/{key}/v1/chat/completions"
        ours = measure("clawpipe", proxy.pid, path, port, core0)
        report["clawpipe"] = ours
        rss = rss_run(proxy.pid, path, port, args.rss_calls, core0)
        report["clawpipe_rss"] = rss
        print(f"clawpipe  RSS after {rss['calls']} captured calls: {rss}", flush=True)
        if not args.no_bodies:  # after the RSS run: 24 MB bodies would raise its starting figure
            report["clawpipe_request_body_cpu_ms_per_mb"] = request_bodies(proxy.pid, path, port)
        captured = sum(f.stat().st_size for f in (tmp / "captures").iterdir())
        report["captured_mb"] = round(captured / 2**20, 1)
        proxy.send_signal(signal.SIGTERM)
        proxy.wait(60)
        shutil.rmtree(tmp / "captures", ignore_errors=True)

        peer = None
        if args.no_peer:
            report["peer_error"] = "skipped (--no-peer)"
        else:
            try:
                ppid, pport, route = start_peer(up_port, core1)
                procs.append(ppid)
                peer = measure("peer", ppid, route, pport, core0)
                report["peer_rss_mb_after_cases"] = round(tree_rss(ppid) / 2**20, 1)
                kill_tree(ppid)
            except (RuntimeError, subprocess.SubprocessError, OSError, ValueError) as exc:
                report["peer_error"] = str(exc)
                print(f"peer unavailable: {exc}", flush=True)
        report["peer"] = peer
        land_ms = {kind: landing_cpu_ms(kind, n, tmp) for kind, n in (("small", 3000), ("large", 200))}
        report["landing_cpu_ms_per_call"] = {k: round(v, 4) for k, v in land_ms.items()}
    finally:
        for pid in reversed(procs):
            kill_tree(pid)
        shutil.rmtree(tmp, ignore_errors=True)

    ratios = {case: ratio(peer, ours, case) for case in ours}
    report["ratio_cpu_peer_over_clawpipe"] = ratios
    added = {c: round(ours[c]["median_ms"] - alone[c]["median_ms"], 3) for c in ("small_1", "large_1")}
    report["added_median_latency_ms"] = added
    # end to end: the proxy defers parsing to landing, so its capture costs proxy + landing CPU per call;
    # the peer parses in line (and keeps calls in memory), so its figure stands alone
    both = {c: round(ours[c]["cpu_ms_per_call"] + land_ms[c.split("_")[0]], 4) for c in ours}
    report["proxy_plus_landing_cpu_ms_per_call"] = both
    report["ratio_cpu_peer_over_proxy_plus_landing"] = {
        c: (round(peer[c]["cpu_ms_per_call"] / both[c], 2) if peer and peer.get(c) else None) for c in ours
    }
    print(
        f"proxy + landing cpu ms/call {both}; peer/(proxy + landing) "
        f"{report['ratio_cpu_peer_over_proxy_plus_landing']}" + ("" if peer else " (peer unavailable: ours alone)")
    )
    small = [r for r in (ratios["small_1"], ratios["small_32"]) if r is not None]
    large = [r for r in (ratios["large_1"], ratios["large_32"]) if r is not None]
    report["targets"] = {
        "small_cpu_ratio_ge_6": (min(small) >= 6) if small else None,
        "large_cpu_ratio_ge_3": (min(large) >= 3) if large else None,
        "added_latency_small_1_lt_1ms": added["small_1"] < 1.0,
        "rss_lt_200mb": report["clawpipe_rss"]["rss_mb_max"] < 200,
    }
    cpu = "/".join(f"{ours[c]['cpu_ms_per_call']:.3f}" for c in ours)
    report["loadavg_end"] = report["load"] = _load()  # shared machine: the load beside the figures
    print(
        f"summary: clawpipe cpu ms/call {cpu} ({', '.join(ours)}); peer/clawpipe {ratios}; added median {added} ms;"
        f" load {load()}"
    )
    print(json.dumps(report, separators=(",", ":")))


if __name__ == "__main__":
    main()
