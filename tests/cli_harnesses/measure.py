"""Measure each real CLI harness against the scripted upstream: time per rollout, calls, request sizes, memory.

Run: .venv/bin/python -m tests.cli_harnesses.measure [--runs 3] [VARIANT ...]   (after the install script)

Each rollout is the two-call script of the tests (a shell tool call, then text), run through launch.py as a
plain subprocess. Peak memory is the largest sum of RSS over the launcher's process tree, sampled every
50 ms. Prints one line per harness and mode, then one JSON line with every figure (medians).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from tests.cli_harnesses.support import REPO, VARIANTS, harness_env, write_task
from tests.support.upstream import ScriptedUpstream, shell_then_reply


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_once(variant: str, mode: str) -> dict[str, Any]:
    harness, _, extra = VARIANTS[variant]
    with (
        tempfile.TemporaryDirectory(prefix="cp-measure-") as tmp,
        ScriptedUpstream(default=shell_then_reply(), model="tiny") as up,
    ):
        workdir = Path(tmp) / "work"
        workdir.mkdir()
        task = write_task(Path(tmp) / "task.json")
        env = harness_env(up.url, workdir, task, extra={"CLAWPIPE_CLI_MODE": mode, **extra})
        t0 = time.monotonic()
        popen = subprocess.Popen(
            [sys.executable, str(REPO / "harnesses" / harness / "launch.py")],
            cwd=workdir,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        peak = 0
        proc = psutil.Process(popen.pid)
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, tree_rss(proc))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = popen.wait(timeout=300)
        seconds = time.monotonic() - t0
        done.set()
        sampler.join()
        reqs = up.model_requests()
        return {
            "exit": code,
            "seconds": seconds,
            "calls": len(reqs),
            "first_request_bytes": len(reqs[0].body) if reqs else 0,
            "last_request_bytes": len(reqs[-1].body) if reqs else 0,
            "peak_rss_mb": peak / 2**20,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("variants", nargs="*", help=f"default: all of {list(VARIANTS)}")
    args = parser.parse_args()
    figures: dict[str, Any] = {}
    for harness in args.variants or VARIANTS:
        for mode in ("minimal", "full"):
            runs = [run_once(harness, mode) for _ in range(args.runs)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "exit"}
            med["failures"] = sum(r["exit"] != 0 for r in runs)
            figures[f"{harness}/{mode}"] = med
            print(
                f"{harness:18s} {mode:8s} {med['seconds']:5.2f} s/rollout  {med['calls']:.0f} calls  "
                f"first {med['first_request_bytes'] / 1024:5.1f} KB  last {med['last_request_bytes'] / 1024:5.1f} KB  "
                f"peak {med['peak_rss_mb']:5.0f} MB  failures {med['failures']}"
            )
    print(json.dumps({k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
