"""Sandbox throughput: start-to-exit latency per backend, 64 concurrent rollouts, runner memory vs batch size.

Run: ``.venv/bin/python bench/sandbox_throughput.py`` (as root, with bubblewrap; docker is measured when an
engine answers or dockerd is installed, else reported as null). Prints human lines, then one JSON line.

1. Start-to-exit of a trivial Python harness (``pass``) through each backend's ``run`` (sandbox setup,
   cgroup, bridge listener, exit, teardown), next to a bare ``subprocess.run`` of the same, over 200
   starts each (``CLAWPIPE_BENCH_STARTS``; docker a tenth): CPU time per sandbox, counted by a cgroup v1
   ``cpuacct`` group the bench puts itself in (:class:`CpuCounter`: the runner and every process of the
   sandbox, its PID namespace included; docker adds the engine's container group), and wall-clock
   quantiles (p10/p50/p90/p99).
2. Wall time of 64 concurrent rollouts of a short harness (two HTTP calls to a loopback upstream through
   the bridge) with bwrap, and the number of infra errors (target 0).
3. The runner's peak RSS for 64 and for 512 short rollouts, each in a fresh process (results stream to
   disk, so it should not grow with the batch).
Ratios last: bwrap's added median latency over the process backend (target <= 30 ms).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHORT = """
import json, os, urllib.request
for _ in range(2):
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": os.environ["OPENAI_MODEL"], "messages": []}).encode(),
        headers={"content-type": "application/json", "authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    reply = json.loads(urllib.request.urlopen(req, timeout=10).read())
open(os.path.join(os.environ["CLAWPIPE_OUTPUT"], "answer.txt"), "w").write(reply["choices"][0]["message"]["content"])
"""


def latency(backend_name: str, n: int, tmp: Path, proxy_url: str, cpu: CpuCounter) -> tuple[list[float], list[float]]:
    """(wall seconds from start to exit, CPU seconds) of a trivial harness through one backend's run().

    CPU is what ``cpu`` counts around each run: with the cgroup counter, the runner and every process of
    the sandbox (for docker, plus the engine's container group)."""
    from clawpipe.sandbox import load_manifest
    from clawpipe.sandbox.backends import SandboxJob, get_backend
    from clawpipe.sandbox.bridge import Bridge
    from tests.sandbox.support import make_harness

    m = load_manifest(make_harness(tmp / f"h-{backend_name}", "trivial", "pass\n"))
    backend = get_backend(backend_name)
    times, cpus = [], []
    with Bridge(proxy_url) as bridge:
        for i in range(n + 1):
            rdir = tmp / f"lat-{backend_name}-{i}"
            (rdir / "work" / "out").mkdir(parents=True)
            (rdir / "task.json").write_text("{}")
            if backend_name != "process":
                for p in (rdir / "work", rdir / "work" / "out"):
                    os.chown(p, 65534, 65534)
            job = SandboxJob(f"lat{i}", m, rdir, "k", "m", 30.0, m.limits)
            c0 = cpu.read(with_docker=backend_name == "docker")
            t0 = time.perf_counter()
            out = backend.run(job, bridge)
            dt = time.perf_counter() - t0
            dc = cpu.read(with_docker=backend_name == "docker") - c0
            if out.exit_code != 0:
                raise RuntimeError(f"{backend_name} trivial harness failed: {job.stderr_path.read_text()[-500:]}")
            if i:  # the first run warms caches (and imports the docker image)
                times.append(dt)
                cpus.append(dc)
    backend.close()
    return times, cpus


class CpuCounter:
    """CPU seconds of this process and of every process it starts, wherever those fork off to.

    bwrap forks the sandbox away from its parent into a new PID namespace, so rusage of reaped children
    misses the harness. The counter instead puts this process into a cgroup of its own in the cgroup v1
    ``cpuacct`` hierarchy (``<mount>/<own group>/clawpipe-bench-<pid>``) and reads its ``cpuacct.usage``:
    every process started afterwards lands in that group or below it (a sandbox's own cgroups are made under
    the runner's), and v1 accounting is hierarchical, so the sandbox's setup, its namespace's pid 1, the
    harness and the runner's own threads all count. Where no v1 ``cpuacct`` is writable (cgroup v2 would
    need the runner to leave its group, and the sandboxes' controllers with it), it falls back to rusage of
    this process and its reaped children and says so in :attr:`kind`.

    Docker containers live under the engine's ``docker`` group, not the runner's: :meth:`read` adds that
    group's usage when ``with_docker`` (shared with any other engine's containers running meanwhile).
    """

    def __init__(self) -> None:
        self.group: Path | None = None
        self.parent: Path | None = None
        self.docker: Path | None = None
        mount = _cpuacct_mount()
        if mount is not None and os.geteuid() == 0:
            own = _own_cgroup("cpuacct")
            parent = mount / own.lstrip("/")
            group = parent / f"clawpipe-bench-{os.getpid()}"
            try:
                group.mkdir(exist_ok=True)
                (group / "cgroup.procs").write_text(str(os.getpid()))
                self.group, self.parent = group, parent
            except OSError:
                _rmdir(group)
            if (mount / "docker" / "cpuacct.usage").exists():
                self.docker = mount / "docker"
        self.kind = f"cgroup v1 cpuacct.usage of {self.group}" if self.group else "rusage (self + reaped children)"

    def read(self, with_docker: bool = False) -> float:
        if self.group is None:
            me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
            return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
        ns = int((self.group / "cpuacct.usage").read_text())
        if with_docker and self.docker is not None:
            ns += int((self.docker / "cpuacct.usage").read_text())
        return ns / 1e9

    def close(self) -> None:
        """Leave the group (back to the one this process came from) and remove it."""
        if self.group is None or self.parent is None:
            return
        try:
            (self.parent / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            return
        _rmdir(self.group)
        self.group = None


def _cpuacct_mount() -> Path | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        rfields = right.split()
        if len(rfields) >= 3 and rfields[0] == "cgroup" and "cpuacct" in rfields[2].split(","):
            return Path(left.split()[4])
    return None


def _own_cgroup(controller: str) -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if controller in ctrls.split(","):
            return path
    return "/"


def _rmdir(path: Path) -> None:
    for _ in range(50):  # a group can stay busy for a moment after its last process left
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)


def bare_latency(n: int, cpu: CpuCounter) -> tuple[list[float], list[float]]:
    times, cpus = [], []
    for _ in range(n):
        c0 = cpu.read()
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        times.append(time.perf_counter() - t0)
        cpus.append(cpu.read() - c0)
    return times, cpus


def quantiles_ms(v: list[float]) -> dict[str, float] | None:
    """p10, p50, p90, p99 and the mean in ms."""
    if not v:
        return None
    q = statistics.quantiles(v, n=100, method="inclusive") if len(v) > 1 else v * 99
    return {
        "p10": round(q[9] * 1000, 2),
        "p50": round(statistics.median(v) * 1000, 2),
        "p90": round(q[89] * 1000, 2),
        "p99": round(q[98] * 1000, 2),
        "mean": round(statistics.fmean(v) * 1000, 2),
    }


def batch(n: int, concurrency: int, backend: str, proxy_url: str, tmp: Path) -> dict[str, Any]:
    """Run n short rollouts; return wall time, statuses and this process's peak RSS."""
    import resource

    from clawpipe.sandbox import RolloutSpec, load_manifest, run_rollouts
    from tests.sandbox.support import EchoTaskSet, make_harness

    echo = EchoTaskSet()
    m = load_manifest(make_harness(tmp, "short", SHORT))
    specs = [RolloutSpec(run_id="bench", iteration=0, harness=m, task=t, model="m") for t in echo.generate(n)]
    t0 = time.perf_counter()
    results = run_rollouts(
        specs,
        proxy_url=proxy_url,
        backend=backend,
        concurrency=concurrency,
        results_path=tmp / "results.jsonl",
        secret=b"bench",
        scratch_dir=tmp / "scratch",
        task_sets={"echo": echo},
    )
    wall = time.perf_counter() - t0
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    return {
        "n": n,
        "wall_s": round(wall, 3),
        "statuses": statuses,
        "infra_errors": statuses.get("infra_error", 0),
        "rewarded": sum(1 for r in results if r.reward == 1.0),
        "calls": sum(r.n_calls for r in results),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def batch_in_subprocess(n: int, concurrency: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--batch", str(n), str(concurrency)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def docker_engine() -> tuple[str | None, Any]:
    """DOCKER_HOST of an engine that answers, starting a private dockerd if needed (stopped at the end)."""
    from tests.support.dockerd import PrivateDockerd, engine_answers

    if engine_answers(os.environ.get("DOCKER_HOST")):
        return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock", None
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        return None, None
    engine = PrivateDockerd()
    try:
        host = engine.start()
    except RuntimeError:
        engine.stop()
        return None, None
    os.environ["DOCKER_HOST"] = host
    return host, engine


def main() -> None:
    from tests.sandbox.support import Upstream

    cpu = CpuCounter()  # first: every process started from here on is counted
    print(f"CPU per sandbox counted by {cpu.kind}")
    up = Upstream()
    tmp = Path(tempfile.mkdtemp(prefix="clawpipe-bench-"))
    engine = None
    try:
        starts = int(os.environ.get("CLAWPIPE_BENCH_STARTS", "200"))
        bare = bare_latency(starts, cpu)
        proc = latency("process", starts, tmp, up.url, cpu)
        bw = latency("bwrap", starts, tmp, up.url, cpu)
        host, engine = docker_engine()
        dock = latency("docker", max(1, starts // 10), tmp, up.url, cpu) if host else ([], [])
        runs = {"bare": bare, "process": proc, "bwrap": bw, "docker": dock}
        med = {k: statistics.median(w) * 1000 if w else None for k, (w, _) in runs.items()}
        wall_q = {k: quantiles_ms(w) for k, (w, _) in runs.items()}
        cpu_q = {k: quantiles_ms(c) for k, (_, c) in runs.items()}
        for k, (w, _) in runs.items():
            if not w:
                print(f"start-to-exit {k:8}: n/a (no docker engine)")
                continue
            wq, cq = wall_q[k] or {}, cpu_q[k] or {}
            print(
                f"start-to-exit {k:8} ({len(w)} starts): wall p50 {wq['p50']:.1f} p90 {wq['p90']:.1f} "
                f"p99 {wq['p99']:.1f} ms; CPU per sandbox p50 {cq['p50']:.1f} mean {cq['mean']:.1f} ms "
                f"[load {' '.join(f'{x:.1f}' for x in os.getloadavg())}]"
            )
        b64 = batch_in_subprocess(64, 64)
        print(
            f"64 concurrent short rollouts (bwrap): {b64['wall_s']:.2f} s, {b64['statuses']}, "
            f"{b64['calls']} calls, runner peak RSS {b64['peak_rss_mb']} MB"
        )
        b512 = batch_in_subprocess(512, 64)
        print(
            f"512 short rollouts (bwrap, concurrency 64): {b512['wall_s']:.2f} s, {b512['statuses']}, "
            f"runner peak RSS {b512['peak_rss_mb']} MB"
        )
        added = med["bwrap"] - med["process"]
        figures = {
            "latency_median_ms": {k: (round(v, 2) if v is not None else None) for k, v in med.items()},
            "starts": {k: len(w) for k, (w, _) in runs.items()},
            "wall_ms": wall_q,
            "cpu_ms_per_sandbox": cpu_q,
            "cpu_counter": cpu.kind,
            "concurrent64": b64,
            "batch512": b512,
            "ratios": {
                "bwrap_added_ms_over_process": round(added, 2),
                "bwrap_added_ms_over_bare": round(med["bwrap"] - med["bare"], 2),
                "bwrap_over_process": round(med["bwrap"] / med["process"], 3),
                # CPU is what a sandbox costs the machine; wall time mostly measures the machine's load
                "bwrap_added_cpu_ms_over_process": round(cpu_q["bwrap"]["mean"] - cpu_q["process"]["mean"], 2),
                "docker_over_process": round(med["docker"] / med["process"], 3) if med["docker"] else None,
                "rss_512_over_64": round(b512["peak_rss_mb"] / b64["peak_rss_mb"], 3),
            },
            "targets_met": {
                "bwrap_added_le_30ms": added <= 30.0,
                "zero_infra_errors_64": b64["infra_errors"] == 0,
            },
        }
        print(
            f"bwrap adds {added:.1f} ms median over the process backend (target <= 30 ms); "
            f"RSS 512/64 = {figures['ratios']['rss_512_over_64']}"
        )
        figures["load"] = [round(x, 1) for x in os.getloadavg()]  # shared machine: the load beside the figures
        print(json.dumps(figures))
    finally:
        up.close()
        if engine is not None:
            engine.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        cpu.close()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--batch":
        from tests.sandbox.support import Upstream

        upstream = Upstream()
        workdir = Path(tempfile.mkdtemp(prefix="clawpipe-bench-batch-"))
        try:
            print(json.dumps(batch(int(sys.argv[2]), int(sys.argv[3]), "bwrap", upstream.url, workdir)))
        finally:
            upstream.close()
            shutil.rmtree(workdir, ignore_errors=True)
    else:
        main()
