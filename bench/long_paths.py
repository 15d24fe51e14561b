"""Benchmark: training memory and time of ONE long path (4k to 64k tokens) with the small policy on CPU.

The path is an append-only agent session: turns of tool output (896 tokens) and a generated reply (128
tokens), one call per turn, each call extending the previous one, so the tree is a single chain and its
micro-batch runs causal attention without a mask. The path is far above the default
max_tokens_per_micro_batch (4096): it trains in a micro-batch of its own. A second rollout in the group
repeats the first call with another reward, so GRPO has reward variance (its tokens lie on the path).

Each size runs one full training step (forward, backward, optimizer) in a fresh process:
- memory: peak RSS above the process's RSS just before the step (psutil, sampled every 2 ms; torch keeps
  no allocator statistics on CPU), so it counts activations, gradients and optimizer state. The worker runs
  with glibc's mmap threshold fixed at 64 KiB, so freed tensors leave RSS at once (live memory, not what
  malloc retained);
- time: CPU seconds of the step per path token (single-threaded; CPU time is the stable measure on a
  shared machine; wall time is printed too).
The slope is the least-squares fit of peak memory against path length (bytes per extra token); linear
growth shows as a roughly constant per-token figure across sizes. ``--checkpointing-at N`` also measures
the path of N tokens with activation checkpointing on.

Run: `python bench/long_paths.py [--sizes 4096,16384,32768,65536] [--checkpointing-at 16384]`.
The small policy is built by `clawpipe model init --size small` in a temporary directory.
Prints human lines, then one JSON line (with the machine's load average).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TURN_CONTEXT, TURN_REPLY = 896, 128


def make_batch(n_tokens: int, vocab: int, config: Any) -> Any:
    import numpy as np

    from clawpipe.train.batch import build_batch
    from clawpipe.train.data import RolloutInfo
    from tests.trees.training import build_tree

    rng = np.random.default_rng(0)
    path = rng.integers(10, vocab, n_tokens).tolist()
    seqs = []
    end = 0
    while end + TURN_CONTEXT + TURN_REPLY <= n_tokens:
        prompt_end = end + TURN_CONTEXT
        end = prompt_end + TURN_REPLY
        lps = (-rng.random(TURN_REPLY)).tolist()
        seqs.append(dict(tokens=path[:end], n_prompt=prompt_end, rollout_id="long", old_logprobs=lps))
    seqs.append(dict(seqs[0], rollout_id="short"))
    infos = {"long": RolloutInfo("long", "g", "bench", 1.0), "short": RolloutInfo("short", "g", "bench", 0.0)}
    return build_batch([build_tree("path", seqs)], infos, config, policy_version=None)


def worker(policy: str, n_tokens: int, checkpointing: bool) -> dict:
    import psutil
    import torch

    from clawpipe.train.checkpoint import load_policy
    from clawpipe.train.config import make_config
    from clawpipe.train.trainer import Trainer

    torch.set_num_threads(1)
    cfg = make_config(device="cpu", learning_rate=1e-5, activation_checkpointing=checkpointing)
    loaded = load_policy(policy)
    batch = make_batch(n_tokens, loaded.model.config.vocab_size, cfg)
    trainer = Trainer(loaded.model, cfg)
    mbs = trainer.pack(batch, "tree")
    assert len(mbs) == 1 and mbs[0].n_tokens == batch.unique_tokens, "one path, one micro-batch"
    assert mbs[0].tree is not None and len(mbs[0].tree.segments) == 1, "a chain is one causal segment"
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0, c0 = time.perf_counter(), time.process_time()
    metrics = trainer.step(batch)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    stop.set()
    thread.join()
    return {
        "tokens": batch.unique_tokens,
        "trained_tokens": int(metrics["tokens/trained"]),
        "peak_mb": (peak[0] - base) / 2**20,
        "cpu_s": cpu,
        "wall_s": wall,
        "checkpointing": checkpointing,
    }


def run_worker(policy: Path, n_tokens: int, checkpointing: bool) -> dict:
    cmd = [sys.executable, __file__, "--worker", str(policy), "--tokens", str(n_tokens)]
    if checkpointing:
        cmd.append("--checkpointing")
    # glibc otherwise raises its mmap threshold up to 32 MB after the first large free and keeps freed
    # tensors in its heap, so RSS would show retained, not live, memory; a fixed 64 KiB threshold maps every
    # tensor of note separately and returns it to the OS when freed
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"worker for {n_tokens} tokens failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,16384,32768,65536", help="path lengths in tokens, comma-separated")
    ap.add_argument("--checkpointing-at", type=int, default=16384, help="also measure this size checkpointed (0: no)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.tokens, args.checkpointing)))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="clawpipe-long-paths-") as tmp:
        policy = Path(tmp) / "small"
        subprocess.run(
            [sys.executable, "-m", "clawpipe", "model", "init", str(policy), "--size", "small"],
            check=True,
            capture_output=True,
        )
        rows = []
        for n in sizes:
            r = run_worker(policy, n, checkpointing=False)
            rows.append(r)
            kib = r["peak_mb"] * 1024 / r["tokens"]
            print(f"{r['tokens']:>6} tokens: peak +{r['peak_mb']:.0f} MB ({kib:.1f} KiB/token), {r['cpu_s']:.1f} s "
                  f"CPU ({r['cpu_s'] / r['tokens'] * 1e3:.2f} ms/token), wall {r['wall_s']:.1f} s")  # fmt: skip
        ckpt = None
        if args.checkpointing_at:
            ckpt = run_worker(policy, args.checkpointing_at, checkpointing=True)
            print(f"{ckpt['tokens']:>6} tokens with activation checkpointing: peak +{ckpt['peak_mb']:.0f} MB, "
                  f"{ckpt['cpu_s']:.1f} s CPU")  # fmt: skip
    xs = [float(r["tokens"]) for r in rows]
    mem_slope = slope(xs, [r["peak_mb"] * 2**20 for r in rows]) if len(rows) > 1 else None
    if mem_slope is not None:
        print(f"memory slope {mem_slope / 1024:.1f} KiB per extra token (least squares over {len(rows)} sizes)")
    result = {
        "policy": "small",
        "memory": "peak RSS delta over the step (psutil, 2 ms sampling, MALLOC_MMAP_THRESHOLD_=65536)",
        "clock": "CPU",
        "sizes": [r["tokens"] for r in rows],
        "peak_mb": [round(r["peak_mb"], 1) for r in rows],
        "kib_per_token": [round(r["peak_mb"] * 1024 / r["tokens"], 2) for r in rows],
        "ms_per_token": [round(r["cpu_s"] / r["tokens"] * 1e3, 3) for r in rows],
        "wall_s": [round(r["wall_s"], 2) for r in rows],
        "slope_kib_per_token": round(mem_slope / 1024, 2) if mem_slope is not None else None,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    if ckpt is not None:
        plain = next((r for r in rows if r["tokens"] == ckpt["tokens"]), None)
        result["checkpointing"] = {"tokens": ckpt["tokens"], "peak_mb": round(ckpt["peak_mb"], 1)}
        if plain is not None:
            result["checkpointing"]["saving"] = round(1 - ckpt["peak_mb"] / plain["peak_mb"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
