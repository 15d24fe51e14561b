"""Distributed training: 2 gloo ranks (FSDP2-sharded policy, trees split by rank) equal 1 process.

One torch.distributed.run launch takes every configuration (GRPO and PPO x every aggregation); the
single-process side runs here. Loss, gradients after one accumulate and weights after one step must
agree within 1e-5.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from clawpipe.train.batch import build_batch
from clawpipe.train.config import make_config
from clawpipe.train.distributed import assign_trees
from clawpipe.train.trainer import Trainer
from tests.train.helpers import random_group_trees, set_rewards, tiny_model

AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "per-rollout-mean"]
CONFIGS = [
    dict(algorithm=alg, aggregation=agg, max_tokens_per_micro_batch=48, entropy_coef=0.01, epochs=2)
    for alg in ("grpo", "ppo")
    for agg in AGGREGATIONS
]
TOL = 1e-5
ROOT = Path(__file__).resolve().parents[2]


def test_assign_trees_balances_unique_tokens_and_keeps_trees_whole():
    shares = assign_trees([100, 10, 60, 50, 40, 5], 2)
    assert sorted(i for s in shares for i in s) == list(range(6))
    loads = [sum([100, 10, 60, 50, 40, 5][i] for i in s) for s in shares]
    assert sorted(loads) == [125, 140]  # largest first onto the lighter rank; the even split is 133 / 132
    assert [len(s) for s in assign_trees([30, 30, 30, 30], 2)] == [2, 2]
    assert assign_trees([7], 3) == [[0], [], []]  # a rank may get nothing (it runs padding forwards)


def single_process(model_dir: Path, trees, infos, cfg) -> dict:
    def load():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")

    def named(trainer: Trainer, attr: str) -> dict[str, torch.Tensor]:
        out = {f"model.{n}": getattr(p, attr).clone() for n, p in trainer.model.named_parameters()}
        if trainer.value_head is not None:
            out.update({f"value_head.{n}": getattr(p, attr).clone() for n, p in trainer.value_head.named_parameters()})
        return out

    batch = build_batch(trees, infos, cfg, policy_version=3)
    trainer = Trainer(load(), cfg, policy_version=3)
    trainer.optimizer.zero_grad()
    sums = trainer.accumulate(batch, trainer.pack(batch))
    grads = named(trainer, "grad")
    trainer = Trainer(load(), cfg, policy_version=3)
    metrics = trainer.step(batch)
    return {"loss": sums["loss/total"], "grads": grads, "weights": named(trainer, "data"), "metrics": metrics}


def max_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float]:
    assert a.keys() == b.keys()
    err = max(float((a[k] - b[k]).abs().max()) for k in a)
    scale = max(float(b[k].abs().max()) for k in b)
    return err, scale


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(tmp_path):
    torch.set_num_threads(1)
    trees, infos = random_group_trees(5, n_groups=3, versions=(2, 3))
    set_rewards(infos, {"g0r0": 1.0, "g0r1": 0.0, "g1r0": 0.0, "g1r1": 1.0, "g2r0": 0.5, "g2r1": 0.0})
    tiny_model(seed=1).save_pretrained(tmp_path / "policy")
    configs = [make_config(device="cpu", **c) for c in CONFIGS]
    job = {"trees": trees, "infos": infos, "model": str(tmp_path / "policy"), "configs": configs}
    (tmp_path / "job.pkl").write_bytes(pickle.dumps(job))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(ROOT / "tests/train/dist_worker.py"), str(tmp_path / "job.pkl"), str(tmp_path / "out.pt")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = torch.load(tmp_path / "out.pt", weights_only=False)
    for cfg, dist in zip(configs, results, strict=True):
        assert all(dist["share"]), "both ranks must hold trees"
        assert dist["metrics"]["dist/world_size"] == 2.0
        one = single_process(tmp_path / "policy", trees, infos, cfg)
        what = f"{cfg.algorithm}/{cfg.aggregation}"
        assert abs(dist["loss"] - one["loss"]) <= TOL * max(1.0, abs(one["loss"])), what
        err, scale = max_err(dist["grads"], one["grads"])
        assert scale > 0 and err <= TOL * max(1.0, scale), (what, err)
        err, scale = max_err(dist["weights"], one["weights"])
        assert err <= TOL * max(1.0, scale), (what, err)
        assert abs(dist["metrics"]["loss/total"] - one["metrics"]["loss/total"]) <= TOL * max(1.0, scale), what
        assert dist["metrics"]["tokens/forward"] == one["metrics"]["tokens/forward"], what


@pytest.mark.slow
def test_pipeline_worker_runs_nproc_2_steps_as_distributed_launches(home: Path, tmp_path: Path):
    """train = { nproc = 2 } through the run's training process: the same update as one process, a sharded
    checkpoint beside a plain HF folder that loads alone, and a second step resuming the sharded optimizer."""
    from clawpipe.configfile import write_config
    from clawpipe.pipeline.train_worker import TrainWorker
    from clawpipe.serving.policy import init_policy
    from clawpipe.train.checkpoint import load_policy
    from clawpipe.train.step import train_step
    from tests.train.test_step import RUN, write_lake

    policy = init_policy(tmp_path / "v0", size="tiny", seed=0)
    for it in (0, 1):
        write_lake(home / "lake", policy, iteration=it)
    dist_cfg = make_config(device="cpu", nproc=2, epochs=2)

    def request(iteration: int, start: Path) -> dict:
        return {
            "run_id": RUN,
            "iteration": iteration,
            "config": str(write_config(dist_cfg, tmp_path / f"config-{iteration}.json")),
            "policy": str(start),
            "out": str(tmp_path / "w"),
            "metrics_out": str(tmp_path / f"metrics-{iteration}.json"),
            "mlflow_run_id": None,
        }

    worker = TrainWorker(tmp_path / "trainer.log")
    try:
        worker.step(request(0, policy))
        first = json.loads((tmp_path / "metrics-0.json").read_text())
        worker.step(request(1, Path(first["checkpoint"])))
        second = json.loads((tmp_path / "metrics-1.json").read_text())
    finally:
        worker.close()
    assert first["metrics"]["dist/world_size"] == 2.0 and first["policy_version"] == 1
    ckpt = Path(first["checkpoint"])
    assert (ckpt / "sharded" / ".metadata").is_file() and not (ckpt / "optimizer.pt").exists()
    assert "optimizer state restored" in (tmp_path / "trainer.log").read_text()
    assert second["policy_version"] == 2

    single = make_config(device="cpu", epochs=2)
    direct = train_step(RUN, 0, lake_root=home / "lake", policy_dir=policy, out_dir=tmp_path / "d", config=single)
    assert first["metrics"]["loss/total"] == pytest.approx(direct.metrics["loss/total"], abs=TOL)
    a = load_policy(ckpt).model.state_dict()
    b = load_policy(direct.checkpoint_dir).model.state_dict()
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= TOL
    # the second step equals one process resuming from the first step's (unsharded) optimizer state
    direct2 = train_step(
        RUN, 1, lake_root=home / "lake", policy_dir=direct.checkpoint_dir, out_dir=tmp_path / "d", config=single
    )
    a = load_policy(Path(second["checkpoint"])).model.state_dict()
    b = load_policy(direct2.checkpoint_dir).model.state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= TOL


def test_launcher_command_standalone_and_multi_node():
    from clawpipe.errors import ConfigError
    from clawpipe.train.launch import launcher_command

    one = launcher_command(4)
    assert one[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node=4", "--standalone"]
    assert one[-3:] == ["-m", "clawpipe", "train"]
    multi = launcher_command(8, nnodes=2, rdzv_endpoint="node0:29500", rdzv_id="r-3")
    assert "--nnodes=2" in multi and "--rdzv-endpoint=node0:29500" in multi and "--rdzv-backend=c10d" in multi
    assert "--standalone" not in multi
    with pytest.raises(ConfigError, match="rdzv_endpoint"):
        launcher_command(8, nnodes=2)
    with pytest.raises(ConfigError, match="rdzv_endpoint"):
        make_config(nnodes=2)


@pytest.mark.slow
def test_cli_train_nproc_2(home: Path, tmp_path: Path):
    """`clawpipe train --nproc 2` launches the ranks itself and prints rank 0's summary."""
    import os

    from clawpipe.serving.policy import init_policy
    from tests.train.test_step import RUN, write_lake

    policy = init_policy(tmp_path / "v0", size="tiny", seed=0)
    write_lake(home / "lake", policy, iteration=0)
    (tmp_path / "train.toml").write_text('device = "cpu"\n')
    cmd = [sys.executable, "-m", "clawpipe", "train", "--run", RUN, "--iteration", "0", "--nproc", "2"]
    cmd += ["--config", str(tmp_path / "train.toml"), "--policy", str(policy), "--out", str(tmp_path / "out")]
    cmd += ["--no-track", "--metrics-out", str(tmp_path / "m.json")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ranks 2" in proc.stdout and "policy_version 1" in proc.stdout
    done = json.loads((tmp_path / "m.json").read_text())
    assert done["metrics"]["dist/world_size"] == 2.0
    assert (Path(done["checkpoint"]) / "sharded" / ".metadata").is_file()
