"""GPU check: a training step and the engine on one CUDA device, with a random Qwen2-shaped policy.

Nothing is downloaded and no vLLM is needed: the policy is built from a config (Qwen2-0.5B's shape: hidden
896, 24 layers, 14 heads / 2 KV heads, MLP 4864, vocab 151,936, tied embeddings, about 0.49B parameters)
with random weights. Three parts, each printed as it ends, then one JSON line:

1. tree-packed vs flat training step in bf16 on the same GRPO batch (groups of 8 multi-turn rollouts
   sharing a long prompt): tokens/s of each layout, the speedup, and the ideal (flattened / unique tokens);
2. one 32k-token path: a training step with activation checkpointing, time and peak memory;
3. clawpipe's engine on the device (a policy of the same shape with the project's small tokenizer):
   requests/s and generated tokens/s at 1 and 64 concurrent clients.

Run: ``scripts/gpu_check.sh`` (about 5 minutes on one H200). ``--cpu-smoke`` runs every part with tiny
sizes on CPU, to check the script itself where no GPU is.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from clawpipe.serving.policy import build_qwen2, init_policy
from clawpipe.serving.server import start_server_process
from clawpipe.train.batch import build_batch
from clawpipe.train.config import make_config
from clawpipe.train.data import RolloutInfo
from clawpipe.train.trainer import Trainer
from tests.trees.training import build_tree

# build_qwen2's arguments: Qwen2-0.5B's shape, and a tiny one for the CPU smoke run
QWEN2_05B = dict(hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, vocab=151936, tie_embeddings=True)
TINY = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512, tie_embeddings=True)
FULL_SIZES = dict(groups=4, prompt=2048, turns=3, completion=128, tool=64, budget=16384, path=32768, seconds=20.0)
SMOKE_SIZES = dict(groups=2, prompt=64, turns=2, completion=8, tool=4, budget=512, path=512, seconds=2.0)


def policy(shape: dict[str, Any], max_positions: int, vocab: int | None = None) -> Any:
    return build_qwen2(**{**shape, "vocab": vocab or shape["vocab"]}, max_positions=max_positions, seed=0)


def group_batch(sizes: dict[str, Any], vocab: int, device: str, **extra: Any):
    rng = np.random.default_rng(0)
    trees, infos = [], {}
    for g in range(sizes["groups"]):
        prompt = rng.integers(10, vocab, sizes["prompt"]).tolist()
        seqs = []
        for i in range(8):
            rid = f"g{g}r{i}"
            infos[rid] = RolloutInfo(rid, f"g{g}", "check", float(i % 2))
            ctx = list(prompt)
            for _ in range(sizes["turns"]):
                comp = rng.integers(10, vocab, sizes["completion"]).tolist()
                seqs.append(dict(tokens=ctx + comp, n_prompt=len(ctx), rollout_id=rid, old_logprobs=[-1.0] * len(comp)))
                ctx = ctx + comp + rng.integers(10, vocab, sizes["tool"]).tolist()
        trees.append(build_tree(f"g{g}", seqs))
    cfg = make_config(device=device, bf16=True, max_tokens_per_micro_batch=sizes["budget"], **extra)
    return build_batch(trees, infos, cfg, policy_version=None), cfg


def long_path_batch(n: int, vocab: int, device: str):
    """One group: a rollout whose single call is an n-token path, and three short ones off the same prompt."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(10, vocab, n - 256).tolist()
    seqs, infos = [], {}
    for i in range(4):
        rid = f"r{i}"
        infos[rid] = RolloutInfo(rid, "g", "check", float(i % 2))
        comp = rng.integers(10, vocab, 256 if i == 0 else 16).tolist()
        seqs.append(dict(tokens=prompt + comp, n_prompt=len(prompt), rollout_id=rid, old_logprobs=[-1.0] * len(comp)))
    cfg = make_config(device=device, bf16=True, activation_checkpointing=True, max_tokens_per_micro_batch=4096)
    return build_batch([build_tree("long", seqs)], infos, cfg, policy_version=None), cfg


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_step(trainer: Trainer, batch: Any, layout: str, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    trainer.step(batch, layout=layout)
    sync(device)
    return time.perf_counter() - t0


def peak_mb(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None


def training(shape: dict[str, Any], sizes: dict[str, Any], device: str) -> dict[str, Any]:
    vocab = shape["vocab"]
    batch, cfg = group_batch(sizes, vocab, device)
    model = policy(shape, sizes["path"] + 64)
    n_params = sum(p.numel() for p in model.parameters())
    trainer = Trainer(model, cfg)
    timed_step(trainer, batch, "tree", device)  # warm-up (kernels, allocator)
    times: dict[str, list[float]] = {"tree": [], "flat": []}
    for _ in range(2):
        for layout in ("tree", "flat"):
            times[layout].append(timed_step(trainer, batch, layout, device))
    t_tree, t_flat = (statistics.median(times[k]) for k in ("tree", "flat"))
    ideal = batch.flattened_tokens / batch.unique_tokens
    out = {
        "params_m": round(n_params / 1e6, 1),
        "flattened_tokens": batch.flattened_tokens,
        "unique_tokens": batch.unique_tokens,
        "tree_step_s": round(t_tree, 3),
        "flat_step_s": round(t_flat, 3),
        "tree_tokens_per_s": round(batch.flattened_tokens / t_tree),
        "flat_tokens_per_s": round(batch.flattened_tokens / t_flat),
        "speedup": round(t_flat / t_tree, 2),
        "ideal": round(ideal, 2),
        "speedup_vs_ideal": round(t_flat / t_tree / ideal, 2),
    }
    print(f"train step ({out['params_m']}M params, {device}, bf16): tree {t_tree:.2f} s, flat {t_flat:.2f} s, "
          f"speedup {out['speedup']}x of ideal {out['ideal']}x", flush=True)  # fmt: skip

    long_batch, long_cfg = long_path_batch(sizes["path"], vocab, device)
    del trainer
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(model, long_cfg)
    t_long = timed_step(trainer, long_batch, "tree", device)
    out["long_path_tokens"] = sizes["path"]
    out["long_path_step_s"] = round(t_long, 2)
    out["long_path_peak_mb"] = peak_mb(device)
    print(f"{sizes['path']}-token path: {t_long:.2f} s, peak {out['long_path_peak_mb']} MB", flush=True)
    return out


async def drive(url: str, clients: int, seconds: float, max_tokens: int) -> dict[str, float]:
    from clawpipe.serving.load import drive_chat

    return await drive_chat(url, clients, seconds, max_tokens=max_tokens)


def engine(shape: dict[str, Any], sizes: dict[str, Any], device: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = init_policy(Path(tmp) / "policy", size="tiny", seed=0)  # the project's tokenizer and template
        model = policy(shape, 8192, vocab=AutoModelForCausalLM.from_pretrained(folder).config.vocab_size)
        model.save_pretrained(folder)
        handle = start_server_process(folder, device=device, max_batch=64, max_model_len=4096, timeout_s=600)
        try:
            asyncio.run(drive(handle.url, 4, 1.0, 64))  # warm-up
            for clients in (1, 64):
                r = asyncio.run(drive(handle.url, clients, sizes["seconds"], 64))
                out[f"engine_c{clients}"] = r
                print(f"engine on {device}, {clients} clients: {r['req_s']} req/s, {r['tok_s']} tok/s", flush=True)
        finally:
            handle.stop()
    out["engine_batching_speedup"] = round(out["engine_c64"]["tok_s"] / max(out["engine_c1"]["tok_s"], 1e-9), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU: checks the script, measures nothing")
    args = ap.parse_args()
    if args.cpu_smoke:
        device, shape, sizes = "cpu", TINY, SMOKE_SIZES
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run on a GPU machine, or pass --cpu-smoke to check the script on CPU")
        device, shape, sizes = "cuda", QWEN2_05B, FULL_SIZES
    t0 = time.monotonic()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)"}
    result.update(training(shape, sizes, device))
    result.update(engine(shape, sizes, device))
    result["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
