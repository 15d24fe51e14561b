"""Benchmark: one training process vs 2 gloo ranks (FSDP2) on CPU, same batch and policy.

Policy: a Qwen2 built from config (the medium shape, ~26M parameters, vocab 512); batch: GRPO group trees
(8 multi-turn rollouts per group sharing a prompt). Each setting runs ``--steps`` training steps in fresh
processes (2 ranks under torch.distributed.run). Per rank: the bytes of parameters, gradients and AdamW
state it holds (its FSDP shards; the 2-rank run should hold about half each) and its peak RSS above the
loaded model (sampled). Throughput: flattened tokens of the batch per second of step (median).

Run: .venv/bin/python bench/distributed_train.py [--steps 2] [--groups 2]
Prints human lines, then one JSON line with both settings, the per-rank state ratio and the load average.
"""

from __future__ import annotations

import argparse
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
from clawpipe.train import distributed
from clawpipe.train.batch import build_batch
from clawpipe.train.config import make_config
from clawpipe.train.data import RolloutInfo
from clawpipe.train.trainer import Trainer
from tests.trees.training import build_tree

VOCAB = 512


def medium_policy() -> torch.nn.Module:
    return build_qwen2(**SIZES["medium"], vocab=VOCAB, max_positions=4096, seed=0)


def make_batch(groups: int):
    rng = np.random.default_rng(0)
    trees, infos = [], {}
    for g in range(groups):
        prompt = rng.integers(10, VOCAB, 256).tolist()
        seqs = []
        for i in range(8):
            rid = f"g{g}r{i}"
            infos[rid] = RolloutInfo(rid, f"g{g}", "bench", float(rng.random()))
            ctx = list(prompt)
            for _ in range(2):
                comp = rng.integers(10, VOCAB, 32).tolist()
                seqs.append(dict(tokens=ctx + comp, n_prompt=len(ctx), rollout_id=rid, old_logprobs=[-1.0] * 32))
                ctx = ctx + comp + rng.integers(10, VOCAB, 16).tolist()
        trees.append(build_tree(f"g{g}", seqs))
    cfg = make_config(device="cpu", max_tokens_per_micro_batch=1024, learning_rate=1e-5)
    return build_batch(trees, infos, cfg, policy_version=None), cfg


def local_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes this process holds: a sharded tensor counts its local shard only."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    ctx = distributed.init_from_env("cpu")
    batch, cfg = make_batch(args.groups)
    trainer = Trainer(medium_policy(), cfg, dist=ctx)
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    grad_bytes = [0]

    def count_grads(*_: object) -> None:  # gradients exist from backward to the step's end: count them there
        grad_bytes[0] = local_bytes([p.grad for p in trainer.params if p.grad is not None])

    trainer.optimizer.register_step_pre_hook(count_grads)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    times, forward = [], 0.0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        m = trainer.step(batch)
        times.append(time.perf_counter() - t0)
        forward = m.get("dist/forward_tokens_busiest_rank", m["tokens/forward"])
    stop.set()
    thread.join()
    opt = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    mine = {
        "rank": ctx.rank if ctx else 0,
        "params_mb": local_bytes(trainer.params) / 2**20,
        "grads_mb": grad_bytes[0] / 2**20,
        "optimizer_mb": local_bytes(opt) / 2**20,
        "peak_rss_above_model_mb": (peak[0] - base) / 2**20,
        "step_s": statistics.median(times),
        "flattened_tokens": batch.flattened_tokens,
        "forward_tokens_busiest_rank": forward,
    }
    ranks = [mine]
    if ctx is not None:
        gathered: list = [None] * ctx.world
        torch.distributed.all_gather_object(gathered, mine)
        ranks = gathered
        distributed.shutdown()
    if ctx is None or ctx.is_main:
        Path(args.worker_out).write_text(json.dumps(ranks))


def run(nproc: int, args: argparse.Namespace, out: Path) -> list[dict]:
    script = [str(Path(__file__).resolve()), "--worker-out", str(out), "--steps", str(args.steps)]
    script += ["--groups", str(args.groups)]
    if nproc == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def summary(ranks: list[dict]) -> dict:
    step = max(r["step_s"] for r in ranks)  # the step ends with the slowest rank
    return {
        "ranks": len(ranks),
        "step_s": round(step, 3),
        "tokens_per_s": round(ranks[0]["flattened_tokens"] / step, 1),
        "per_rank": [
            {k: round(v, 1) if isinstance(v, float) else v for k, v in r.items() if k != "flattened_tokens"}
            for r in ranks
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_out:
        worker(args)
        return
    load_before = os.getloadavg()[0]
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    one = summary(run(1, args, tmp / f"dist-bench-1-{os.getpid()}.json"))
    two = summary(run(2, args, tmp / f"dist-bench-2-{os.getpid()}.json"))
    state = lambda r: r["params_mb"] + r["grads_mb"] + r["optimizer_mb"]  # noqa: E731
    ratio = max(state(r) for r in two["per_rank"]) / state(one["per_rank"][0])
    for name, s in (("1 process", one), ("2 gloo ranks", two)):
        print(f"{name}: step {s['step_s']} s, {s['tokens_per_s']} flattened tokens/s")
        for r in s["per_rank"]:
            print(f"  rank {r['rank']}: params {r['params_mb']} MB, grads {r['grads_mb']} MB, AdamW "
                  f"{r['optimizer_mb']} MB, peak RSS +{r['peak_rss_above_model_mb']} MB")  # fmt: skip
    load = os.getloadavg()
    print(f"per-rank state (params + grads + AdamW) of 2 ranks / 1 process: {ratio:.2f}; load {load[0]:.1f}")
    print(json.dumps({"one": one, "two": two, "state_ratio_per_rank": round(ratio, 3),
                      "speedup": round(one["step_s"] / two["step_s"], 2),
                      "load_avg_before": round(load_before, 1), "load_avg_1m": round(load[0], 1),
                      "cpus": os.cpu_count()}))  # fmt: skip


if __name__ == "__main__":
    main()
