"""Benchmark: one GRPO train step on the same batch, packed as prefix trees vs flattened sequences.

Batch: groups of 8 production-shaped rollouts from bench/tree_data.py (bench/data.py's distributions: log-normal
lengths around ``--prompt`` / ``--completion``, ~``--turns`` calls per rollout, each prompt extending the last,
a task prompt shared by the group, retries, choices, drift, sub-agents, compaction at ``--context``), ids
folded into the policy's vocabulary. Policy: a small Qwen2 built from config (~3.4M parameters, vocab 512).
Run: `python bench/tree_training.py [--quick]`.

Prints human lines, then one JSON line with: step times (median, interleaved runs), speedup
(flat / tree), ideal (flattened / unique tokens), ratio = speedup / ideal (target >= 0.75), peak memory of
each layout (separate processes), the micro-batch token budget, and the largest row's attention mask: the
tree attention's block mask (block x widest keys, 0 for chains) beside what a dense n x n bool mask would take.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import psutil
import torch

from clawpipe.serving.policy import SIZES, build_qwen2
from clawpipe.train.batch import build_batch
from clawpipe.train.config import make_config
from clawpipe.train.data import RolloutInfo
from clawpipe.train.trainer import Trainer
from tests.trees.training import build_tree

sys.path.insert(0, str(Path(__file__).resolve().parent))

import data
import tree_data

VOCAB = 512


def small_policy(seed: int = 0) -> torch.nn.Module:
    return build_qwen2(**SIZES["small"], vocab=VOCAB, max_positions=8192, seed=seed)


def make_batch(args: argparse.Namespace):
    """Groups of 8 production-shaped rollouts (bench/tree_data.py) with their ids folded into the policy's
    vocabulary; failed and retokenized calls are left out, as training leaves them out."""
    shp = data.Shape(args.prompt, args.completion, args.turns, context=args.context)
    trees, infos = [], {}
    for group in tree_data.groups(args.groups, shp, group_size=8, seed=args.seed):
        seqs = []
        for row in group:
            rid = row["rollout_id"]
            infos.setdefault(rid, RolloutInfo(rid, row["group_id"], "bench", row["reward"]))
            if row["status"] != "ok" or row["token_source"] != "upstream":
                continue
            prompt, comp = row["prompt_token_ids"] % VOCAB, row["completion_token_ids"] % VOCAB
            seqs.append(
                dict(
                    tokens=np.concatenate([prompt, comp]).tolist(),
                    n_prompt=len(prompt),
                    rollout_id=rid,
                    call_id=row["call_id"],
                    choice_index=row["choice_index"],
                    old_logprobs=row["completion_logprobs"].tolist(),
                )
            )
        trees.append(build_tree(group[0]["group_id"], seqs))
    cfg = make_config(max_tokens_per_micro_batch=args.budget, learning_rate=1e-5)
    return build_batch(trees, infos, cfg, policy_version=None), cfg


def one_step(trainer: Trainer, batch, layout: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one training step."""
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.step(batch, layout=layout)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0


def worker(args: argparse.Namespace) -> None:
    """One step of one layout in a fresh process: peak RSS above the loaded model and batch (sampled)."""
    torch.set_num_threads(1)
    batch, cfg = make_batch(args)
    trainer = Trainer(small_policy(), cfg)
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
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    one_step(trainer, batch, args.worker)
    stop.set()
    thread.join()
    out = {"peak_rss_mb": (peak[0] - base) / 2**20}
    if trainer.device.type == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=768, help="median prompt tokens (the shared task: a third)")
    ap.add_argument("--turns", type=int, default=3, help="median calls per rollout")
    ap.add_argument("--completion", type=int, default=48, help="median sampled tokens per call")
    ap.add_argument("--context", type=int, default=3072, help="prompts that would pass it are compacted")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=int, default=4096, help="tokens per packed micro-batch")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a smaller batch for a fast check")
    ap.add_argument("--worker", choices=["tree", "flat"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.prompt, args.context, args.reps = 512, 1024, 1
    if args.worker:
        worker(args)
        return
    torch.set_num_threads(1)
    batch, cfg = make_batch(args)
    ideal = batch.flattened_tokens / batch.unique_tokens
    base = small_policy()
    n_params = sum(p.numel() for p in base.parameters())
    trainers = {layout: Trainer(copy.deepcopy(base), cfg) for layout in ("tree", "flat")}
    mbs = trainers["tree"].pack(batch, "tree")
    print(f"policy: {n_params / 1e6:.2f}M params on {trainers['tree'].device}; batch: {args.groups} groups x 8 "
          f"rollouts, ~{args.turns} calls each, prompts ~{args.prompt} tokens")  # fmt: skip
    print(f"tokens: flattened {batch.flattened_tokens}, unique {batch.unique_tokens}, ideal speedup {ideal:.2f}x; "
          f"{len(mbs)} packed micro-batch(es) of <= {args.budget} tokens")  # fmt: skip
    for layout in ("tree", "flat"):  # warm-up
        one_step(trainers[layout], batch, layout)
    times: dict[str, list[tuple[float, float]]] = {"tree": [], "flat": []}
    for _ in range(args.reps):
        for layout in ("tree", "flat"):
            times[layout].append(one_step(trainers[layout], batch, layout))
    # On a shared CPU machine other processes steal wall time; the step is single-threaded, so its own CPU
    # time is the stable measure there. On CUDA, wall time.
    k = 0 if trainers["tree"].device.type == "cuda" else 1
    t_tree = statistics.median(t[k] for t in times["tree"])
    t_flat = statistics.median(t[k] for t in times["flat"])
    wall = {layout: statistics.median(t[0] for t in times[layout]) for layout in times}
    speedup = t_flat / t_tree
    mem = {}
    for layout in ("tree", "flat"):
        cmd = [sys.executable, __file__, "--worker", layout] + [
            f"--{k}={getattr(args, k)}"
            for k in ("groups", "prompt", "turns", "completion", "context", "seed", "budget")
        ]
        mem[layout] = json.loads(
            subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1]
        )
    max_n = max(mb.n_tokens for mb in mbs)
    # float32 additive block mask of the tree attention (built at the first forward; its size is known now)
    tree_mask_mb = max(mb.tree.block * mb.tree.mask_width * 4 / 2**20 if mb.tree else 0.0 for mb in mbs)
    clock = "wall" if k == 0 else "CPU"
    print(f"step time ({clock}): tree {t_tree:.3f} s, flat {t_flat:.3f} s (median of {args.reps}, interleaved); "
          f"wall: tree {wall['tree']:.3f} s, flat {wall['flat']:.3f} s")  # fmt: skip
    key = "peak_cuda_mb" if "peak_cuda_mb" in mem["tree"] else "peak_rss_mb"
    print(f"peak memory of a step ({key}): tree {mem['tree'][key]:.0f} MB, flat {mem['flat'][key]:.0f} MB; largest "
          f"packed row {max_n} tokens: tree attention mask {tree_mask_mb:.2f} MB (a dense bool mask: "
          f"{max_n * max_n / 2**20:.1f} MB)")  # fmt: skip
    print(f"speedup {speedup:.2f}x vs ideal {ideal:.2f}x: ratio {speedup / ideal:.2f} (target >= 0.75)")
    result = {
        "params_m": round(n_params / 1e6, 2),
        "flattened_tokens": batch.flattened_tokens,
        "unique_tokens": batch.unique_tokens,
        "clock": clock,
        "tree_step_s": round(t_tree, 4),
        "flat_step_s": round(t_flat, 4),
        "tree_wall_s": round(wall["tree"], 4),
        "flat_wall_s": round(wall["flat"], 4),
        "tree_peak_mb": round(mem["tree"][key], 1),
        "flat_peak_mb": round(mem["flat"][key], 1),
        "budget_tokens": args.budget,
        "mask_mb": round(tree_mask_mb, 3),
        "dense_mask_mb": round(max_n * max_n / 2**20, 2),
        "speedup": round(speedup, 3),
        "ideal": round(ideal, 3),
        "ratio": round(speedup / ideal, 3),
    }
    result["load"] = [round(x, 1) for x in os.getloadavg()]  # shared machine: the load beside the figures
    print(json.dumps(result))


if __name__ == "__main__":
    main()
