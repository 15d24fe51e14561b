"""Benchmark: prefix-tree building (clawpipe.trees.build_forest) vs a naive greedy linear merge vs one vectorised pass.

Input: ``--rollouts`` production-shaped rollouts from ``bench/tree_data.py`` (bench/data.py's distributions,
``--shape`` large by default: prompts log-normal around 16k tokens, 512 sampled, ~6 calls per rollout, Zipf ids),
in groups of ``--group-size`` sharing a task prompt, each call's prompt extending the previous one, with
retries, n=2 choices, drift, sub-agents, failed and retokenized calls, and compaction of prompts that would
pass ``--context``. Input arrives group batch by group batch as Arrow tables shaped like
``sql/trees/calls.sql`` rows (drawn outside the timed region).

Measured in one run, on one core, as process CPU time (the machine is shared; wall time is noise),
the median of ``--repeat`` timings per batch:
- builder: ``build_forest`` (rollout and group trees) per batch, unique tokens / s (the tokens the rollout
  trees keep) beside flattened tokens / s (every replayed prompt token counted again);
- naive: peers' greedy linear merge in plain Python (append a call to the current row when it extends it,
  else start a new row) over Python lists, on the first ``--naive-rollouts`` rollouts (lists of Python ints
  need ~30 bytes per token, so the full size would not fit);
- floor: one vectorised numpy pass over every flattened token (a per-sequence checksum with
  ``np.add.reduceat`` over the Arrow value buffers): reading the input once, the floor any builder pays;
- peak RSS against the input size and the largest batch; what the builder adds to the peak of drawing and
  holding the same input without building (a first pass), against a measured floor: the bytes of the largest
  batch's unique token ids themselves (int32; batches are built one at a time);
- long rollouts (``--long-turns``, 100 and 800 by default): one rollout whose every prompt replays the previous
  prompt and answer (a system prompt, then 30 answer and 20 user ids per turn), built alone; unique tokens / s
  at each length and their ratio (1 when the builder's work follows the unique tokens; the flattened tokens
  grow with the square of the turns).

Run: ``.venv/bin/python bench/tree_build.py`` (default 1,000 large rollouts, about a minute);
``--rollouts 200`` for a quick run. Last line: JSON, with the load average.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import data
import tree_data

from clawpipe.trees import build_forest


def shape_of(args: argparse.Namespace) -> data.Shape:
    shp = data.shape(args.shape)
    shp.turns = args.turns or shp.turns
    shp.context = args.context
    return shp


def batches(args: argparse.Namespace, n_groups: int) -> Iterator[pa.Table]:
    """The input, ``--batch-groups`` groups per table (the SQL stage's batches), drawn lazily."""
    per = max(1, args.batch_groups)
    rows: list[dict] = []
    for k, group in enumerate(tree_data.groups(n_groups, shape_of(args), group_size=args.group_size, seed=args.seed)):
        rows.extend(group)
        if (k + 1) % per == 0 or k + 1 == n_groups:
            t = tree_data.table(rows)
            rows = []  # the drawn rows go before the builder runs: the peak is the builder's and its input's
            yield t


def flattened_of(t: pa.Table) -> int:
    return len(t["prompt_token_ids"].combine_chunks().values) + len(t["completion_token_ids"].combine_chunks().values)


def floor_pass(t: pa.Table) -> int:
    """One vectorised pass over every flattened token: a per-sequence checksum (reads each token once)."""
    total = 0
    for name in ("prompt_token_ids", "completion_token_ids"):
        arr = t[name].combine_chunks()
        vals = arr.values.to_numpy()
        starts = arr.offsets.to_numpy()[:-1]
        nonempty = starts < len(vals)
        if len(vals):
            total += int(np.add.reduceat(vals, starts[nonempty], dtype=np.int64).sum())
    return total


def naive_merge(rows: list[tuple[str, list[int], list[int]]]) -> int:
    """Peers' greedy linear merge: unique tokens kept as rows (rollout by rollout, calls in order)."""
    kept = 0
    current: list[int] = []
    last_rollout = None
    for rollout, prompt, completion in rows:
        seq = prompt + completion
        if rollout == last_rollout and seq[: len(current)] == current:
            current = seq
        else:
            kept += len(current)
            current = seq
        last_rollout = rollout
    return kept + len(current)


def long_rollout(turns: int, seed: int = 0, system: int = 2000, answer: int = 30, user: int = 20) -> pa.Table:
    """One rollout of ``turns`` calls, each prompt the previous prompt + answer + a user message (calls.sql rows)."""
    rng = np.random.default_rng(seed)
    history = rng.integers(0, 150_000, system + turns * (answer + user), dtype=np.int32)
    plen = system + np.arange(turns, dtype=np.int64) * (answer + user)
    p_off = np.zeros(turns + 1, dtype=np.int64)
    np.cumsum(plen, out=p_off[1:])
    prompts = np.concatenate([history[:n] for n in plen.tolist()])  # each call's prompt, as the lake holds it
    completions = np.concatenate([history[n : n + answer] for n in plen.tolist()])  # replayed verbatim next turn
    c_off = np.arange(turns + 1, dtype=np.int32) * answer
    return pa.table(
        {
            "call_id": [f"long-{k}" for k in range(turns)],
            "choice_index": pa.array(np.zeros(turns, dtype=np.int32)),
            "rollout_id": ["long"] * turns,
            "seq": pa.array(np.arange(turns, dtype=np.int64)),
            "group_id": ["long-group"] * turns,
            "status": ["ok"] * turns,
            "token_source": ["upstream"] * turns,
            "prompt_token_ids": pa.LargeListArray.from_arrays(pa.array(p_off), pa.array(prompts)),
            "completion_token_ids": pa.ListArray.from_arrays(pa.array(c_off), pa.array(completions)),
            "completion_logprobs": pa.ListArray.from_arrays(
                pa.array(c_off), pa.array(np.full(turns * answer, -0.5, dtype=np.float32))
            ),
        }
    )


def long_rollouts(turns: list[int], repeat: int) -> dict[str, float]:
    """Unique tokens / s of building one long rollout at each length (median of ``repeat``), and the ratio."""
    out: dict[str, float] = {}
    for n in turns:
        t = long_rollout(n)
        times = []
        for _ in range(repeat):
            t0 = time.process_time()
            stats = build_forest(t, run_id="bench", iteration=0, scopes=("rollout",)).stats
            times.append(time.process_time() - t0)
        unique = int(pa.compute.sum(stats["unique_tokens"]).as_py())
        flat = int(pa.compute.sum(stats["flattened_tokens"]).as_py())
        out[f"turns_{n}_s"] = round(statistics.median(times), 4)
        out[f"turns_{n}_unique_tokens"] = unique
        out[f"turns_{n}_flattened_tokens"] = flat
        out[f"turns_{n}_unique_tokens_per_s"] = round(unique / statistics.median(times))
        del t
    first, last = turns[0], turns[-1]
    out["unique_rate_ratio"] = round(
        out[f"turns_{last}_unique_tokens_per_s"] / out[f"turns_{first}_unique_tokens_per_s"], 2
    )
    return out


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=1000)
    ap.add_argument("--shape", choices=sorted(data.SHAPES), default="large", help="bench/data.py's call shape")
    ap.add_argument("--turns", type=int, default=0, help="median calls per rollout (0: the shape's)")
    ap.add_argument("--context", type=int, default=65536, help="prompts that would pass it are compacted")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--batch-groups", type=int, default=4, help="groups per input batch (the SQL stage's batches)")
    ap.add_argument("--naive-rollouts", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="timings per batch; the median counts")
    ap.add_argument("--long-turns", default="100,800", help="turns of the long rollouts, comma-separated ('' skips)")
    args = ap.parse_args()
    n_groups = max(1, args.rollouts // args.group_size)

    build_forest(tree_data.table(next(tree_data.groups(1, data.shape("small"), seed=99))), run_id="w", iteration=0)
    base_rss = rss_mb()
    for _t in batches(args, n_groups):  # drawing and holding the input alone: the peak the builder adds to
        del _t
    input_rss = rss_mb()
    t_build = t_floor = 0.0
    flat_total = unique_total = nodes_total = 0
    input_bytes = biggest = 0
    causes = {c: 0 for c in ("retry", "choice", "rewrite", "subagent", "drift", "rollout")}
    calls_total = biggest_unique = 0
    for t in batches(args, n_groups):
        flat = flattened_of(t)
        calls_total += len(t)
        nbytes = t.nbytes
        input_bytes += nbytes
        biggest = max(biggest, nbytes)
        gc.collect()
        builds, floors = [], []
        for _ in range(args.repeat):
            t0 = time.process_time()
            nodes, stats, _ = build_forest(t, run_id="bench", iteration=0)
            builds.append(time.process_time() - t0)
            t0 = time.process_time()
            floor_pass(t)
            floors.append(time.process_time() - t0)
        t_build += statistics.median(builds)
        t_floor += statistics.median(floors)
        flat_total += flat
        rs = stats.filter(pa.compute.equal(stats["scope"], "rollout"))
        batch_unique = int(pa.compute.sum(rs["unique_tokens"]).as_py())
        unique_total += batch_unique
        biggest_unique = max(biggest_unique, batch_unique)
        nodes_total += len(nodes)
        for c in causes:
            causes[c] += int(pa.compute.sum(stats[f"branches_{c}"]).as_py())
        del nodes, stats, t
    peak = rss_mb()

    # naive, on a prefix of the same data (python lists are ~8x bigger than the Arrow input)
    naive_groups = max(1, args.naive_rollouts // args.group_size)
    rows: list[tuple[str, list[int], list[int]]] = []
    sub = pa.concat_tables(list(batches(argparse.Namespace(**{**vars(args), "batch_groups": 1}), naive_groups)))
    naive_tables = [sub.sort_by([("rollout_id", "ascending"), ("seq", "ascending"), ("choice_index", "ascending")])]
    t0 = time.process_time()
    for t in naive_tables:
        rows.extend(
            zip(
                t["rollout_id"].to_pylist(),
                t["prompt_token_ids"].to_pylist(),
                t["completion_token_ids"].to_pylist(),
                strict=True,
            )
        )
    t_convert = time.process_time() - t0
    del naive_tables
    naive_flat = sum(len(p) + len(c) for _, p, c in rows)
    naive_times, sub_times = [], []
    for _ in range(args.repeat):
        t0 = time.process_time()
        naive_unique = naive_merge(rows)
        naive_times.append(time.process_time() - t0)
        t0 = time.process_time()
        sub_stats = build_forest(sub, run_id="bench", iteration=0, scopes=("rollout",)).stats
        sub_times.append(time.process_time() - t0)
    t_naive, t_sub = statistics.median(naive_times), statistics.median(sub_times)
    sub_unique = int(pa.compute.sum(sub_stats["unique_tokens"]).as_py())
    del rows, sub

    long_turns = [int(x) for x in args.long_turns.split(",") if x.strip()]
    long = long_rollouts(long_turns, args.repeat) if long_turns else {}

    rate = flat_total / t_build
    naive_rate = naive_flat / t_naive
    floor_rate = flat_total / t_floor
    res = {
        "rollouts": n_groups * args.group_size,
        "shape": args.shape,
        "median_turns": shape_of(args).turns,
        "context": args.context,
        "calls": calls_total,
        "flattened_tokens": flat_total,
        "unique_tokens_rollout_scope": unique_total,
        "nodes": nodes_total,
        "branches": causes,
        "builder_s": round(t_build, 3),
        "builder_tokens_per_s": round(rate),  # flattened: every replayed prompt token counted again
        "builder_unique_tokens_per_s": round(unique_total / t_build),  # the tokens the trees keep
        "flattened_per_unique": round(flat_total / max(1, unique_total), 2),
        "floor_s": round(t_floor, 3),
        "floor_tokens_per_s": round(floor_rate),
        "builder_vs_floor_time_ratio": round(t_build / t_floor, 2),
        "naive_rollouts": naive_groups * args.group_size,
        "naive_tokens_per_s": round(naive_rate),
        "naive_with_list_conversion_tokens_per_s": round(naive_flat / (t_naive + t_convert)),
        "naive_unique_tokens": naive_unique,
        "builder_unique_tokens_same_subset": sub_unique,
        "builder_subset_tokens_per_s": round(naive_flat / t_sub),
        "builder_vs_naive_speed_ratio": round(naive_flat / t_sub / naive_rate, 2),
        "builder_vs_naive_with_conversion_ratio": round((t_naive + t_convert) / t_sub, 2),
        "input_mb": round(input_bytes / 2**20, 1),
        "largest_batch_mb": round(biggest / 2**20, 1),
        "peak_rss_mb": round(peak, 1),
        # memory against a measured floor: the bytes of the unique token ids themselves (int32); batches are
        # built one at a time, so the floor of the peak is the largest batch's unique ids
        "unique_ids_mb": round(unique_total * 4 / 2**20, 1),
        "largest_batch_unique_ids_mb": round(biggest_unique * 4 / 2**20, 1),
        "rss_growth_mb": round(peak - base_rss, 1),
        "rss_growth_input_only_mb": round(input_rss - base_rss, 1),  # the same batches drawn, not built
        "builder_rss_mb": round(peak - input_rss, 1),
        "builder_rss_vs_batch_unique_ids": round((peak - input_rss) / max(biggest_unique * 4 / 2**20, 1e-9), 2),
        "base_rss_mb": round(base_rss, 1),
        "target_tokens_per_s": 20_000_000,
        "meets_rate_target": rate >= 20e6,
        "meets_floor_target": t_build / t_floor <= 10,
        "long_rollout": long,
    }
    print(
        f"input: {res['rollouts']} rollouts of {args.shape} calls ({calls_total:,} rows, median "
        f"{res['median_turns']} turns, context {args.context}); "
        f"{flat_total:,} flattened tokens ({res['input_mb']} MB Arrow, largest batch {res['largest_batch_mb']} MB)"
    )
    print(
        f"builder: {t_build:.2f} s  {unique_total / t_build / 1e6:.2f} M unique tok/s  "
        f"{rate / 1e6:.1f} M flattened tok/s  "
        f"({nodes_total:,} nodes, both scopes; branches {causes})"
    )
    print(
        f"floor (one vectorised pass): {t_floor:.2f} s  {floor_rate / 1e6:.1f} M tok/s  "
        f"-> builder/floor time {t_build / t_floor:.1f}x"
    )
    print(
        f"naive greedy linear merge (plain Python, {res['naive_rollouts']} rollouts): {naive_rate / 1e6:.1f} M tok/s "
        f"({res['naive_with_list_conversion_tokens_per_s'] / 1e6:.1f} M tok/s counting Arrow -> list conversion); "
        f"{naive_unique:,} unique tokens kept vs the builder's {sub_unique:,} on the same subset; "
        f"builder/naive speed on that subset {res['builder_vs_naive_speed_ratio']:.2f}x "
        f"({res['builder_vs_naive_with_conversion_ratio']:.2f}x with conversion)"
    )
    print(
        f"peak RSS {peak:.0f} MB (start {base_rss:.0f} MB, drawing the input alone {input_rss:.0f} MB) for "
        f"{res['input_mb']} MB of input; the builder adds {peak - input_rss:.0f} MB = "
        f"{res['builder_rss_vs_batch_unique_ids']:.1f}x the largest batch's {res['largest_batch_unique_ids_mb']} MB "
        f"of unique token ids (the floor; all batches: {res['unique_ids_mb']} MB)"
    )
    if long:
        lo, hi = long_turns[0], long_turns[-1]
        print(
            f"long rollout: {lo} turns {long[f'turns_{lo}_unique_tokens_per_s'] / 1e6:.2f} M unique tok/s, {hi} turns "
            f"{long[f'turns_{hi}_unique_tokens_per_s'] / 1e6:.2f} M unique tok/s "
            f"({long[f'turns_{hi}_flattened_tokens']:,} flattened); ratio {long['unique_rate_ratio']:.2f} "
            "(1: the work follows the unique tokens)"
        )
    res["load"] = [round(x, 1) for x in os.getloadavg()]  # shared machine: the load beside the figures
    print(json.dumps(res))


if __name__ == "__main__":
    main()
