"""One rank of the distributed equivalence test (run by torch.distributed.run from test_distributed.py).

argv: INPUT.pkl OUTPUT.pt. INPUT holds the trees, rollout infos, the model directory and a list of configs;
rank 0 writes, per config, the batch loss, the full gradients after one accumulate, and the full weights
after one step.
"""

from __future__ import annotations

import pickle
import sys

import torch
from transformers import AutoModelForCausalLM

from clawpipe.train import distributed
from clawpipe.train.batch import build_batch
from clawpipe.train.trainer import Trainer


def main(inp: str, outp: str) -> None:
    torch.set_num_threads(1)
    with open(inp, "rb") as f:
        job = pickle.load(f)
    ctx = distributed.init_from_env("cpu")
    assert ctx is not None, "run under torch.distributed.run with more than one rank"
    results = []
    for cfg in job["configs"]:
        model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32, attn_implementation="sdpa")
        trainer = Trainer(model, cfg, policy_version=3, dist=ctx)
        batch = build_batch(job["trees"], job["infos"], cfg, policy_version=3)
        trainer.optimizer.zero_grad()
        sums = trainer.accumulate(batch, trainer.pack(batch))
        assert trainer.scorer is not None
        grads = {n: p.grad.full_tensor() for n, p in trainer.scorer.named_parameters()}
        trainer.optimizer.zero_grad()
        metrics = trainer.step(batch)
        weights = {n: p.detach().full_tensor() for n, p in trainer.scorer.named_parameters()}
        share = sorted(trainer.share(batch) or ())
        results.append(
            {"loss": sums["loss/total"], "grads": grads, "weights": weights, "metrics": metrics, "share": share}
        )
    if ctx.is_main:
        torch.save(results, outp)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
