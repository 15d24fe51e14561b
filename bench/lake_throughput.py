"""Lake landing throughput, landing into a growing partition, and saved-query latency, on production-shaped calls.

Run: ``.venv/bin/python bench/lake_throughput.py [--small N] [--large N] [--growing N] [--results-landings N]
[--query-calls N] [--landing-only] [--baseline DIR [--rounds K]]``. Every call is drawn by bench/data.py
(multi-turn rollouts, Zipf token ids, varied logprobs, texts and tool calls; small: ~200 prompt + 64 sampled
tokens, large: ~16k + 512, log-normal). Landing is single-threaded and runs in a child process; its rate on one
core is calls / CPU seconds of that process (the figure that holds on a shared machine; the wall-clock rate is
printed beside it), its peak RSS the child's own high-water mark. The growing-partition run lands 10 batches of
``--growing`` calls into one partition, each followed by a landing run of 1,000 new calls whose CPU per call is
reported (flat when no run pays for what is already landed); likewise ``--results-landings`` landing runs of 8
new rollout results each into one partition (CPU per run, last 10 against first 10). Saved queries run over a
lake of ``--query-calls`` small calls (landed in rounds of ``--round``, to bound disk use). Prints human lines
and the machine load, then one JSON line with the figures and their ratios to the targets.

``--baseline DIR`` (a tree holding another version's ``clawpipe/`` and ``sql/``, e.g. ``git archive <rev>
clawpipe sql | tar -x -C DIR``) lands the same captures with that version too, alternating with this one
``--rounds`` times (medians taken), and reports its figures beside these with the ratio: old and new in
one run, on one set of data and one machine load. ``CLAWPIPE_BENCH_CODE=DIR`` runs the whole bench,
saved queries included, with that tree's code.
"""

from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parent.parent
_CODE_ENV = "CLAWPIPE_BENCH_CODE"  # a child lands with the clawpipe of this tree (the --baseline)
sys.path.insert(0, os.environ.get(_CODE_ENV) or str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))

import data  # noqa: E402

TARGET_SMALL, TARGET_LARGE, TARGET_QUERY_S, TARGET_LAND_RSS_MB, TARGET_QUERY_RSS_MB = 20_000, 1_000, 1.0, 1024, 2048
SAVED = (
    "reward_by_harness_iteration",
    "calls_tokens_per_rollout",
    "latency_by_policy_version",
    "retokenized_call_rate",
    "failure_reasons",
)


def land_child(captures: str, lake: str) -> None:
    """Child process body: land on one core, print calls/s and peak RSS as JSON."""
    from clawpipe.lake import land

    warm = Path(tempfile.mkdtemp(prefix="clawpipe-lake-warm-"))
    data.write_segments(warm / "cap", 10, data.shape("small"), per_segment=10, run_id="warm")
    land(warm / "cap", warm / "lake")  # first use of pyarrow's writers and kernels loads code: not landing
    shutil.rmtree(warm)
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    rep = land(captures, lake)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"calls": rep.calls, "wall_s": wall, "cpu_s": cpu, "peak_rss_mb": rss}))


def run_land(captures: Path, lake: Path, code: str | None = None, keep: bool = False) -> dict[str, float]:
    """Land ``captures`` into ``lake`` in a child process (with the clawpipe under ``code``, else this tree's);
    the lake is removed afterwards unless ``keep``."""
    os.sync()  # flush the freshly written segments first: dirty-page writeback would throttle the lander
    env = {**os.environ, _CODE_ENV: code} if code else None
    out = subprocess.run(
        [sys.executable, __file__, "--child-land", str(captures), str(lake)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    if not keep:
        shutil.rmtree(lake, ignore_errors=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def land_rates(captures: Path, lake: Path, rounds: int, baseline: str | None) -> dict[str, dict[str, float]]:
    """Median figures of ``rounds`` landings of the same captures by this tree (and the baseline, alternating)."""
    runs: dict[str, list[dict[str, float]]] = {"new": []}
    if baseline:
        runs["old"] = []
    for _ in range(rounds):
        for who in runs:
            runs[who].append(run_land(captures, lake, baseline if who == "old" else None))
    out = {}
    for who, rs in runs.items():
        out[who] = {
            "calls": rs[0]["calls"],
            "cpu_s": statistics.median(r["cpu_s"] for r in rs),
            "wall_s": statistics.median(r["wall_s"] for r in rs),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
        }
    return out


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def growing_child(lake: str, *caps: str) -> None:
    """Child process body: land each capture dir in turn into one lake, one landing run each."""
    from clawpipe.lake import land

    warm = Path(tempfile.mkdtemp(prefix="clawpipe-lake-warm-"))
    data.write_segments(warm / "cap", 10, data.shape("small"), per_segment=10, run_id="warm")
    land(warm / "cap", warm / "lake")  # first use of pyarrow's writers and kernels: not landing
    shutil.rmtree(warm)
    out = []
    for c in caps:
        cpu0 = time.process_time()
        rep = land(c, lake)
        out.append({"calls": rep.calls, "cpu_s": time.process_time() - cpu0})
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"runs": out, "peak_rss_mb": rss}))


def growing(work: Path, per_batch: int, probe: int = 1000, code: str | None = None) -> dict[str, object]:
    """Grow one partition by 10 batches of ``per_batch`` calls, landing a ``probe`` of new calls after each
    (one landing run each); the probes' CPU per call shows any per-run cost that grows with the partition."""
    caps = []
    for b in range(10):
        caps.append(work / f"cap-grow-{b}")
        data.write_segments(caps[-1], per_batch, data.shape("small"), per_segment=2000, seed=1000 + b)
        caps.append(work / f"cap-probe-{b}")
        data.write_segments(caps[-1], probe, data.shape("small"), per_segment=probe, seed=2000 + b)
    os.sync()
    lake = work / "lake-grow"
    cmd = [sys.executable, __file__, "--child-growing", str(lake), *map(str, caps)]
    env = {**os.environ, _CODE_ENV: code} if code else None
    run = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    out = json.loads(run.stdout.strip().splitlines()[-1])
    us = [r["cpu_s"] / max(1, r["calls"]) * 1e6 for r in out["runs"]]
    bulk, probes = us[0::2], us[1::2]
    for c in caps:
        shutil.rmtree(c)
    shutil.rmtree(lake)
    first, last = statistics.median(probes[:3]), statistics.median(probes[-3:])
    print(
        f"{'baseline ' if code else ''}growing partition: 10 x {per_batch} calls, each followed by a landing run "
        f"of {probe} new calls; "
        f"us/call of those runs {' '.join(f'{u:.0f}' for u in probes)} (partition "
        f"{per_batch + probe:,} -> {10 * (per_batch + probe):,} calls); last 3 / first 3 (medians) = "
        f"{last / first:.2f}; bulk runs us/call {' '.join(f'{u:.0f}' for u in bulk)} [load {load()}]"
    )
    return {
        "growing_probe_us_per_call": [round(u, 1) for u in probes],
        "growing_bulk_us_per_call": [round(u, 1) for u in bulk],
        "growing_last_vs_first": round(last / first, 2),
    }


def results_child(work: str, landings: int, per: int) -> None:
    """Child process body: land ``landings`` result files of ``per`` new rollouts each into one partition, one
    landing run each; print each run's CPU seconds."""
    from clawpipe.lake import land

    caps, lake = Path(work) / "cap-results", Path(work) / "lake-results"
    cpu = []
    for k in range(landings):
        rows = data.rollout_results({f"k{k:05d}-{i}": 1 for i in range(per)}, "bench", 0, seed=k)
        d = caps / "results" / "bench" / "0"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"results-{k:05d}.jsonl").write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows))
        cpu0 = time.process_time()
        land(caps, lake)
        cpu.append(time.process_time() - cpu0)
    print(json.dumps({"cpu_s": cpu}))


def results_growing(work: Path, landings: int, per: int = 8, code: str | None = None) -> dict[str, object]:
    """One iteration's results landed as they come (async mode lands every few seconds): ``landings`` landing
    runs of ``per`` new rollouts each into one partition; CPU per run, last 10 / first 10 (medians)."""
    cmd = [sys.executable, __file__, "--child-results", str(work), str(landings), str(per)]
    env = {**os.environ, _CODE_ENV: code} if code else None
    run = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    ms = [c * 1e3 for c in json.loads(run.stdout.strip().splitlines()[-1])["cpu_s"]]
    shutil.rmtree(work / "cap-results")
    shutil.rmtree(work / "lake-results")
    first, last = statistics.median(ms[:10]), statistics.median(ms[-10:])
    print(
        f"{'baseline ' if code else ''}results landed in {landings} runs of {per} rollouts into one partition: "
        f"ms cpu/run first 10 {first:.1f}, last 10 {last:.1f} (medians), last / first = {last / first:.2f} "
        f"[load {load()}]"
    )
    return {
        "results_first_ms": round(first, 1),
        "results_last_ms": round(last, 1),
        "results_last_vs_first": round(last / first, 2),
    }


def query_child(lake: str) -> None:
    from clawpipe.lake import run_saved

    times = {}
    for name in SAVED:
        run_saved(lake, name)  # warm the OS page cache once
        best = []
        for _ in range(3):
            t0 = time.perf_counter()
            run_saved(lake, name)
            best.append(time.perf_counter() - t0)
        times[name] = sorted(best)[1]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"times": times, "peak_rss_mb": rss}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", type=int, default=100_000, help="small calls for the landing rate")
    ap.add_argument("--large", type=int, default=3_000, help="large calls for the landing rate")
    ap.add_argument("--query-calls", type=int, default=1_000_000, help="calls in the lake the saved queries read")
    ap.add_argument("--round", type=int, default=200_000, help="calls generated and landed per round")
    ap.add_argument("--growing", type=int, default=20_000, help="small calls per batch of the growing partition")
    ap.add_argument("--landing-only", action="store_true", help="skip the saved-query lake")
    ap.add_argument("--baseline", help="a tree with another version's clawpipe/ to land the same captures with too")
    ap.add_argument("--rounds", type=int, default=3, help="landings of each kind per version with --baseline")
    ap.add_argument("--child-land", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--child-query", help=argparse.SUPPRESS)
    ap.add_argument("--child-growing", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--child-results", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--results-landings", type=int, default=200, help="landing runs of new rollout results")
    args = ap.parse_args()
    if args.child_land:
        land_child(*args.child_land)
        return
    if args.child_growing:
        growing_child(*args.child_growing)
        return
    if args.child_results:
        results_child(args.child_results[0], int(args.child_results[1]), int(args.child_results[2]))
        return
    if args.child_query:
        query_child(args.child_query)
        return
    work = Path(tempfile.mkdtemp(prefix="clawpipe-lake-bench-"))
    try:
        figures: dict[str, object] = {}
        # -- landing rate, small and large, each from fresh segments into a fresh lake
        rounds = args.rounds if args.baseline else 1
        for kind, n in (("small", args.small), ("large", args.large)):
            caps, lake = work / f"cap-{kind}", work / f"lake-{kind}"
            size, _ = data.write_segments(caps, n, data.shape(kind), per_segment=100 if kind == "large" else 2000)
            rates = land_rates(caps, lake, rounds, args.baseline)
            for who, r in rates.items():
                rate, wall_rate = r["calls"] / r["cpu_s"], r["calls"] / r["wall_s"]
                print(
                    f"{'baseline ' if who == 'old' else ''}land {kind}: {r['calls']} calls, {size / 1e6:.0f} MB: "
                    f"{r['cpu_s']:.2f}s cpu = {rate:,.0f} calls/s on one core ({r['wall_s']:.2f}s wall = "
                    f"{wall_rate:,.0f} calls/s), peak RSS {r['peak_rss_mb']:.0f} MB, median of {rounds} "
                    f"[load {load()}]"
                )
                key = "baseline" if who == "old" else None
                dest = figures.setdefault("baseline", {}) if key else figures
                assert isinstance(dest, dict)
                dest[f"land_{kind}_calls_per_s"] = round(rate)
                dest[f"land_{kind}_wall_calls_per_s"] = round(wall_rate)
                dest[f"land_{kind}_peak_rss_mb"] = round(r["peak_rss_mb"])
            shutil.rmtree(caps)
        figures.update(growing(work, args.growing))
        figures.update(results_growing(work, args.results_landings))
        if args.baseline:
            base = figures["baseline"]
            assert isinstance(base, dict)
            base.update(growing(work, args.growing, code=args.baseline))
            base.update(results_growing(work, args.results_landings, code=args.baseline))
            figures["new_vs_baseline"] = {
                k: round(figures[f"land_{k}_calls_per_s"] / base[f"land_{k}_calls_per_s"], 2)  # type: ignore[operator]
                for k in ("small", "large")
            }
        figures["load"] = load()
        if args.landing_only:
            print(json.dumps(figures))
            return
        # -- a lake of query-calls small calls, landed in rounds (peak RSS of each landing process)
        caps, lake = work / "cap-q", work / "lake-q"
        peak = 0.0
        landed = 0
        t_land = 0.0
        for k, start in enumerate(range(0, args.query_calls, args.round)):
            n = min(args.round, args.query_calls - start)
            it = k % 10
            _, rollouts = data.write_segments(
                caps, n, data.shape("small"), per_segment=5000, seed=k, iteration=it, start=start
            )
            data.write_results(caps, rollouts, "bench", it, seed=k)
            r = run_land(caps, lake, keep=True)
            peak, landed, t_land = max(peak, r["peak_rss_mb"]), landed + r["calls"], t_land + r["wall_s"]
            for p in caps.glob("*.seg"):
                p.unlink()
        lake_mb = sum(f.stat().st_size for f in lake.rglob("*.parquet")) / 1e6
        print(
            f"lake for queries: {landed} calls ({lake_mb:,.0f} MB of Parquet) landed in {t_land:.1f}s, "
            f"peak landing RSS {peak:.0f} MB"
        )
        figures["query_lake_mb"] = round(lake_mb)
        figures["query_lake_calls"] = landed
        figures["land_1m_peak_rss_mb"] = round(peak)
        out = subprocess.run(
            [sys.executable, __file__, "--child-query", str(lake)], check=True, capture_output=True, text=True
        )
        q = json.loads(out.stdout.strip().splitlines()[-1])
        for name, t in q["times"].items():
            print(f"saved query {name}: {t * 1000:.0f} ms over {landed} calls")
        print(f"query peak RSS {q['peak_rss_mb']:.0f} MB [load {load()}]")
        figures["saved_query_s"] = {k: round(v, 3) for k, v in q["times"].items()}
        figures["saved_query_max_s"] = round(max(q["times"].values()), 3)
        figures["query_peak_rss_mb"] = round(q["peak_rss_mb"])
        figures["ratios"] = {
            "small_rate_vs_target": round(figures["land_small_calls_per_s"] / TARGET_SMALL, 2),
            "large_rate_vs_target": round(figures["land_large_calls_per_s"] / TARGET_LARGE, 2),
            "query_target_vs_max_s": round(TARGET_QUERY_S / max(figures["saved_query_max_s"], 1e-9), 2),
            "land_rss_target_vs_peak": round(TARGET_LAND_RSS_MB / max(peak, 1), 2),
            "query_rss_target_vs_peak": round(TARGET_QUERY_RSS_MB / max(q["peak_rss_mb"], 1), 2),
        }
        print(json.dumps(figures))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
