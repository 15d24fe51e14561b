"""Benchmark: the default pipeline run in sync mode vs async mode, same config and trained groups.

Each mode runs as `clawpipe run` does (its own process: Prefect, engine, proxy, sandboxes, trainer), in one
temporary clawpipe home, one after the other (``--repeats`` alternates them). Both train the same number of
groups (the config's iterations x groups x harnesses); async overlaps each batch's rollouts with the
previous batch's training. Run: `python bench/async_pipeline.py [--iterations N] [--backend process]`.

Prints each run's summary (its reward table) and a line of its figures, then one JSON line: wall time
of each mode (whole command, and the loop alone from the run's summary), the ratios sync / async (target
>= 1.5 on 2 cores), the final reward of each (mean train reward of the last 3 iterations, last held-out
sampled reward), the oldest trained call and the calls async dropped, and the load average before and
after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


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
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{tag} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
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
