"""Benchmark: the default pipeline run in sync mode vs async mode, same config and trained groups.

Each mode runs as `clawpipe run` does (its own process: Prefect, engine, proxy, sandboxes, trainer), in one
temporary clawpipe home, one after the other (``--repeats`` alternates them). Both train the same number of
groups (the config's iterations x groups x harnesses); async overlaps each batch's rollouts with the
previous batch's training. Run: `python bench/async_pipeline.py [--iterations N] [--backend process]`.

Where the time goes, per run:
- **timeline**: seconds each stage was busy, from the task runs the run's Prefect flows recorded (start and
  end of every task run): ``rollout`` (training batches), ``eval`` (held-out rollouts), ``land``,
  ``trees``, ``train``, ``publish``, ``report``; ``loop_span_s`` from the first task's start to the last
  one's end. From sync's timeline, ``ideal_ratio`` = (R + T) / max(R, T) with R the rollout side (training
  and evaluation rollouts and landing: they share the sandboxes and the engine) and T the rest: what a
  perfect overlap of the two sides could gain, if neither slowed the other down.
- **cpu_s**: CPU seconds of the run's process tree by part (``engine``, ``proxy``, ``trainer``, ``flow``:
  the flow process with Prefect's client, landing and trees; ``sandboxes``: harness processes, counted
  when they exit; ``prefect_server``), sampled every second with psutil; ``cpu_bound_ratio`` = sync's
  loop span / (its CPU seconds / 2 cores): what overlap can gain at most on 2 cores when CPU is the limit.

Prints each run's summary (its reward table) and a line of its figures, then one JSON line: wall time
of each mode (whole command, and the loop alone from the run's summary), the ratios sync / async (target
>= 1.5 on 2 cores), the final reward of each (mean train reward of the last 3 iterations, last held-out
sampled reward), the oldest trained call and the calls async dropped, the timelines and CPU of the last
run of each mode, both bounds, and the load average before and after.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
ROLLOUT_SIDE = ("rollout", "eval", "land")
STAGES = {
    "rollout_batch": "rollout",
    "land_batch": "land",
    "reconstruct_batch": "trees",
    "train_policy": "train",
    "publish_policy": "publish",
    "report_iteration": "report",
}


class CpuSampler:
    """CPU seconds of a process tree by part, sampled every ``interval`` s in a thread. A process that
    exits between samples is counted through its parent's reaped-children times (sandboxes: the flow)."""

    def __init__(self, pid: int, interval: float = 1.0) -> None:
        self.root = psutil.Process(pid)
        self.interval = interval
        self.cpu: dict[str, float] = defaultdict(float)
        self._last: dict[int, tuple[float, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)

    @staticmethod
    def part(proc: psutil.Process) -> str:
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            return "sandboxes"
        for needle, name in (
            (" serve ", "engine"),
            (" proxy ", "proxy"),
            ("train_worker", "trainer"),
            (" train ", "trainer"),
            ("prefect.server", "prefect_server"),
            ("flows.pipeline", "flow"),
            (" clawpipe run", "flow"),
        ):
            if needle in cmd:
                return name
        return "sandboxes"

    def sample(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        for proc in procs:
            try:
                t = proc.cpu_times()
            except psutil.Error:
                continue
            own, reaped = t.user + t.system, t.children_user + t.children_system
            last_own, last_reaped = self._last.get(proc.pid, (0.0, 0.0))
            self._last[proc.pid] = (own, reaped)
            part = self.part(proc)
            self.cpu[part] += own - last_own
            # what the flow reaped are sandboxes (bwrap and the harness inside); the others reap nothing big
            self.cpu["sandboxes" if part == "flow" else part] += reaped - last_reaped

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def totals(self) -> dict[str, float]:
        out = {k: round(v, 1) for k, v in sorted(self.cpu.items())}
        out["total"] = round(sum(self.cpu.values()), 1)
        return out


def timeline(prefect_db: Path, run_id: str) -> dict[str, Any]:
    """Busy seconds per stage of one run, from the task runs its flows recorded in Prefect's database.

    A rollout batch is ``eval`` when it ran in an ``-eval<k>`` subflow (async) or after its iteration's
    publish (sync: the held-out rollouts follow the publish in the same subflow).
    """
    con = sqlite3.connect(f"file:{prefect_db}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "select t.name, t.start_time, t.end_time, f.name from task_run t join flow_run f on t.flow_run_id = f.id "
            "where f.name like ? and t.start_time is not null and t.end_time is not null order by t.start_time",
            (f"{run_id}%",),
        ).fetchall()
    finally:
        con.close()

    def ts(value: str) -> float:
        return dt.datetime.fromisoformat(value).timestamp()

    busy: dict[str, float] = defaultdict(float)
    published: set[str] = set()
    first, last = float("inf"), 0.0
    for name, start, end, flow_name in rows:
        stage = STAGES.get(name.rsplit("-", 1)[0])
        if stage is None:
            continue
        if stage == "publish":
            published.add(flow_name)
        in_eval = "-eval" in flow_name[len(run_id) :] or flow_name in published
        if stage in ("rollout", "land") and in_eval:
            stage = "eval"
        busy[stage] += ts(end) - ts(start)
        first, last = min(first, ts(start)), max(last, ts(end))
    out: dict[str, Any] = {k: round(busy.get(k, 0.0), 1) for k in (*ROLLOUT_SIDE, *sorted(set(STAGES.values())))}
    out["loop_span_s"] = round(last - first, 1) if rows else 0.0
    return out


def ideal_ratio(tl: dict[str, Any]) -> float:
    """(R + T) / max(R, T) over a sync timeline: R the rollout side, T the trainer side."""
    r = sum(tl[k] for k in ROLLOUT_SIDE)
    t = sum(v for k, v in tl.items() if k not in ROLLOUT_SIDE and k != "loop_span_s")
    return round((r + t) / max(r, t), 2) if max(r, t) else 0.0


def run_once(home: Path, mode: str, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    config = home / f"{tag}.toml"
    lines = [f'mode = "{mode}"', f'run_name = "{tag}"', 'experiment = "bench-async"']
    if args.iterations:
        lines.append(f"iterations = {args.iterations}")
    if args.backend:
        lines.append(f'backend = "{args.backend}"')
    config.write_text("\n".join(lines) + "\n")
    summary_path = home / f"{tag}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "CLAWPIPE_"))}
    env["CLAWPIPE_HOME"] = str(home)
    cmd = [sys.executable, "-m", "clawpipe", "run", "--config", str(config), "--summary-out", str(summary_path)]
    log_path = home / f"{tag}.log"
    t0 = time.perf_counter()
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
        with CpuSampler(proc.pid) as cpu:
            proc.wait()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{tag} failed (exit {proc.returncode}):\n{log_path.read_text(errors='replace')[-6000:]}")
    summary = json.loads(summary_path.read_text())
    its = summary["iterations"]
    steps = [s["overlap"] for s in its if s.get("overlap")]
    return {
        "mode": mode,
        "wall_s": round(wall, 1),
        "loop_s": round(summary["seconds"], 1),
        "iterations": len(its),
        "trained_rollouts": sum(v["n"] for s in its for v in s["by_harness"].values()),
        "first_reward": round(summary["first_reward"], 4),
        "last3_reward": round(summary["last3_reward"], 4),
        "eval_sampled_last": summary["eval_sampled_last"],
        "max_age": max((o["max_age"] for o in steps), default=0),
        "dropped_calls": sum(o["dropped_calls"] for o in steps),
        "publish_wait_s": round(sum(o.get("publish_wait_s") or 0.0 for o in steps), 1),
        "producer_wait_s": round(sum(o.get("producer_wait_s") or 0.0 for o in steps), 1),
        "timeline": timeline(home / "prefect" / "prefect.db", summary["run_id"]),
        "cpu_s": cpu.totals(),
        "markdown": summary["markdown"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=None, help="override the default config's iterations")
    parser.add_argument("--backend", default=None, help="override the sandbox backend (bwrap|docker|process)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode, alternated; medians reported")
    args = parser.parse_args()
    load_before = [round(x, 2) for x in os.getloadavg()]
    runs: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(prefix="clawpipe-bench-async-") as tmp:
        home = Path(tmp)
        for r in range(args.repeats):
            for mode in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
                result = run_once(home, mode, args, f"{mode}-{r}")
                runs[mode].append(result)
                print(result.pop("markdown"), flush=True)
                print(f"{mode}: {result}", flush=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "loop_s")} for m, rs in runs.items()}
    last = {m: rs[-1] for m, rs in runs.items()}
    sync_tl, sync_cpu = last["sync"]["timeline"], last["sync"]["cpu_s"]
    print(
        json.dumps(
            {
                "iterations": last["sync"]["iterations"],
                "trained_rollouts": {m: r["trained_rollouts"] for m, r in last.items()},
                "repeats": args.repeats,
                "sync_wall_s": med["sync"]["wall_s"],
                "async_wall_s": med["async"]["wall_s"],
                "wall_ratio": round(med["sync"]["wall_s"] / med["async"]["wall_s"], 2),
                "sync_loop_s": med["sync"]["loop_s"],
                "async_loop_s": med["async"]["loop_s"],
                "loop_ratio": round(med["sync"]["loop_s"] / med["async"]["loop_s"], 2),
                "target_ratio": 1.5,
                "ideal_ratio": ideal_ratio(sync_tl),
                "cpu_bound_ratio": round(sync_tl["loop_span_s"] / (sync_cpu["total"] / 2), 2)
                if sync_cpu["total"]
                else None,
                "sync_timeline": sync_tl,
                "async_timeline": last["async"]["timeline"],
                "sync_cpu_s": sync_cpu,
                "async_cpu_s": last["async"]["cpu_s"],
                "async_producer_wait_s": last["async"]["producer_wait_s"],
                "async_publish_wait_s": last["async"]["publish_wait_s"],
                "sync_last3_reward": last["sync"]["last3_reward"],
                "async_last3_reward": last["async"]["last3_reward"],
                "sync_eval_sampled_last": last["sync"]["eval_sampled_last"],
                "async_eval_sampled_last": last["async"]["eval_sampled_last"],
                "async_max_age": last["async"]["max_age"],
                "async_dropped_calls": last["async"]["dropped_calls"],
                "load_avg_before": load_before,
                "load_avg_after": [round(x, 2) for x in os.getloadavg()],
            }
        )
    )


if __name__ == "__main__":
    main()
