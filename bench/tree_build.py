"""Benchmark: prefix-tree building (clawpipe.trees.build_forest) vs a naive greedy linear merge vs one vectorised pass.

Synthetic iteration: ``--rollouts`` rollouts in groups of ``--group-size`` sharing a task prompt, ``--turns``
calls each whose context grows to ``--context`` tokens, plus branches (a retry, a drift, a compaction
rewrite and a 3-call sub-agent in some rollouts, 2 choices on some calls). Input arrives group batch by group
batch as Arrow tables shaped like ``sql/trees/calls.sql`` rows (built outside the timed region).

Measured in one run, on one core, as process CPU time (the machine is shared; wall time is noise),
the median of ``--repeat`` timings per batch:
- builder: ``build_forest`` (rollout and group trees) per batch, unique tokens / s (the tokens the rollout
  trees keep) beside flattened tokens / s (every replayed prompt token counted again);
- naive: peers' greedy linear merge in plain Python (append a call to the current row when it extends it,
  else start a new row) over Python lists, on the first ``--naive-rollouts`` rollouts (lists of Python ints
  need ~30 bytes per token, so the full size would not fit);
- floor: one vectorised numpy pass over every flattened token (a per-sequence checksum with
  ``np.add.reduceat`` over the Arrow value buffers): reading the input once, the floor any builder pays;
- peak RSS against the input size and the largest batch, and its growth against a measured floor: the bytes
  of the unique token ids themselves (int32).

Run: ``.venv/bin/python bench/tree_build.py`` (default 1,000 x 20 turns x 8k, about a minute);
``--rollouts 200`` for a quick run. Last line: JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import time
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

os.environ.setdefault("OMP_NUM_THREADS", "1")

from clawpipe.trees import build_forest

VOCAB = 150_000


def make_group(g: int, args: argparse.Namespace) -> pa.Table:
    """The calls of one group: ``group_size`` rollouts of ``turns`` calls sharing the task prompt."""
    rng = np.random.default_rng(args.seed * 100_003 + g)
    task_len = args.context // 8
    step = (args.context - task_len) // args.turns  # tokens added per turn: tool output + completion
    gen_len = max(1, step // 4)
    task = rng.integers(0, VOCAB, task_len, dtype=np.int32)
    prompts: list[np.ndarray] = []
    comps: list[np.ndarray] = []
    meta: list[tuple[str, int, str, int]] = []  # call_id, choice, rollout_id, seq

    def add(cid: str, rid: str, seq: int, prompt: np.ndarray, comp: np.ndarray, choice: int = 0) -> None:
        prompts.append(prompt)
        comps.append(comp)
        meta.append((cid, choice, rid, seq))

    for r in range(args.group_size):
        rid = f"g{g}-r{r}"
        chain = np.concatenate([task, rng.integers(0, VOCAB, args.context, dtype=np.int32)])
        seq = 0
        kinds = rng.random(4) < args.branch_rate  # retry, drift, rewrite, subagent
        for k in range(args.turns):
            p_end = task_len + k * step + (step - gen_len)
            prompt = chain[:p_end].copy()
            if kinds[1] and k == args.turns // 2:  # the prompt re-encodes the previous completion
                prompt[p_end - (step - gen_len) - gen_len // 2] += 1
            if kinds[2] and k == args.turns - 1:  # compaction: task + a summary
                prompt = np.concatenate([task, rng.integers(0, VOCAB, step, dtype=np.int32)])
            comp = chain[p_end : p_end + gen_len]
            add(f"{rid}-c{k}", rid, seq, prompt, comp)
            seq += 1
            if k == 0 and g % 4 == 0:  # n=2 choices on the first call of some groups
                add(f"{rid}-c{k}", rid, seq - 1, prompt, rng.integers(0, VOCAB, gen_len, dtype=np.int32), 1)
            if kinds[0] and k == args.turns // 3:  # a retry of the same prompt
                add(f"{rid}-c{k}b", rid, seq, prompt, rng.integers(0, VOCAB, gen_len, dtype=np.int32))
                seq += 1
        if kinds[3]:
            sub = np.concatenate([task[:16], rng.integers(0, VOCAB, 3 * step, dtype=np.int32)])
            for k in range(3):
                add(
                    f"{rid}-s{k}",
                    rid,
                    seq,
                    sub[: 16 + k * step + step - gen_len],
                    sub[16 + k * step + step - gen_len :][:gen_len],
                )
                seq += 1

    def lists(arrs: list[np.ndarray]) -> pa.Array:
        off = np.zeros(len(arrs) + 1, dtype=np.int32)
        np.cumsum([len(a) for a in arrs], out=off[1:])
        return pa.ListArray.from_arrays(pa.array(off), pa.array(np.concatenate(arrs)))

    n = len(meta)
    lp = [np.full(len(c), -0.5, dtype=np.float32) for c in comps]
    lp_off = np.zeros(n + 1, dtype=np.int32)
    np.cumsum([len(c) for c in comps], out=lp_off[1:])
    return pa.table(
        {
            "call_id": [m[0] for m in meta],
            "choice_index": pa.array([m[1] for m in meta], pa.int32()),
            "rollout_id": [m[2] for m in meta],
            "seq": pa.array([m[3] for m in meta], pa.int64()),
            "group_id": [f"g{g}"] * n,
            "sample_idx": pa.array([int(m[2].rsplit("r", 1)[1]) for m in meta], pa.int32()),
            "status": ["ok"] * n,
            "token_source": ["upstream"] * n,
            "finish_reason": ["stop"] * n,
            "policy_version": pa.array([1] * n, pa.int64()),
            "reward": pa.array([float(int(m[2].rsplit("r", 1)[1]) % 2) for m in meta]),
            "prompt_token_ids": lists(prompts),
            "completion_token_ids": lists(comps),
            "completion_logprobs": pa.ListArray.from_arrays(pa.array(lp_off), pa.array(np.concatenate(lp))),
        }
    )


def batches(args: argparse.Namespace, n_groups: int) -> Iterator[pa.Table]:
    per = max(1, args.batch_groups)
    for b in range(0, n_groups, per):
        yield pa.concat_tables([make_group(g, args) for g in range(b, min(n_groups, b + per))])


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


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=1000)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--batch-groups", type=int, default=4, help="groups per input batch (the SQL stage's batches)")
    ap.add_argument("--branch-rate", type=float, default=0.3)
    ap.add_argument("--naive-rollouts", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="timings per batch; the median counts")
    args = ap.parse_args()
    n_groups = max(1, args.rollouts // args.group_size)

    build_forest(
        make_group(0, argparse.Namespace(**{**vars(args), "turns": 2, "context": 256})), run_id="w", iteration=0
    )
    base_rss = rss_mb()
    t_build = t_floor = 0.0
    flat_total = unique_total = nodes_total = 0
    input_bytes = biggest = 0
    causes = {c: 0 for c in ("retry", "choice", "rewrite", "subagent", "drift", "rollout")}
    for t in batches(args, n_groups):
        flat = flattened_of(t)
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
        unique_total += int(pa.compute.sum(rs["unique_tokens"]).as_py())
        nodes_total += len(nodes)
        for c in causes:
            causes[c] += int(pa.compute.sum(stats[f"branches_{c}"]).as_py())
        del nodes, stats, t
    peak = rss_mb()

    # naive, on a prefix of the same data (python lists are ~8x bigger than the Arrow input)
    naive_groups = max(1, args.naive_rollouts // args.group_size)
    rows: list[tuple[str, list[int], list[int]]] = []
    naive_tables = [
        make_group(g, args).sort_by([("rollout_id", "ascending"), ("seq", "ascending")]) for g in range(naive_groups)
    ]
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
    sub = pa.concat_tables([make_group(g, args) for g in range(naive_groups)])
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

    rate = flat_total / t_build
    naive_rate = naive_flat / t_naive
    floor_rate = flat_total / t_floor
    res = {
        "rollouts": n_groups * args.group_size,
        "turns": args.turns,
        "context": args.context,
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
        # memory against a measured floor: the bytes of the unique token ids themselves (int32)
        "unique_ids_mb": round(unique_total * 4 / 2**20, 1),
        "rss_growth_vs_unique_ids": round((peak - base_rss) / max(unique_total * 4 / 2**20, 1e-9), 2),
        "base_rss_mb": round(base_rss, 1),
        "target_tokens_per_s": 20_000_000,
        "meets_rate_target": rate >= 20e6,
        "meets_floor_target": t_build / t_floor <= 10,
    }
    print(
        f"input: {res['rollouts']} rollouts x {args.turns} turns -> {args.context} tokens; "
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
        f"peak RSS {peak:.0f} MB (start {base_rss:.0f} MB) for {res['input_mb']} MB of input; growth "
        f"{res['rss_growth_vs_unique_ids']:.1f}x the {res['unique_ids_mb']} MB of unique token ids (the floor)"
    )
    res["load"] = [round(x, 1) for x in os.getloadavg()]  # shared machine: the load beside the figures
    print(json.dumps(res))


if __name__ == "__main__":
    main()
