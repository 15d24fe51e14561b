"""The pipeline's training stage: lake -> packed trees -> one update -> checkpoint v+1 -> publish -> metrics.

result = train_step(run_id, iteration, lake_root=..., policy_dir=..., out_dir=..., config=cfg, tracker=t)
result.checkpoint_dir, result.policy_version, result.metrics
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clawpipe.train.batch import build_batch
from clawpipe.train.checkpoint import load_policy, publish, save_checkpoint
from clawpipe.train.config import TrainConfig
from clawpipe.train.loading import load_trees
from clawpipe.train.trainer import Trainer

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    checkpoint_dir: Path
    policy_version: int
    metrics: dict[str, float] = field(default_factory=dict)
    published: dict[str, Any] | None = None


def train_step(
    run_id: str,
    iteration: int,
    *,
    lake_root: str | os.PathLike[str],
    policy_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    config: TrainConfig,
    tracker: Any = None,
    admin_token: str | None = None,
) -> TrainResult:
    """Train the policy in ``policy_dir`` on iteration ``iteration``'s trees; write ``<out>/policy-v<N+1>``.

    tracker: anything with log_metrics(dict, step) (clawpipe.tracking); params are logged by the caller
    (or here when the tracker has not logged them yet).
    """
    loaded = load_policy(policy_dir)
    reference = load_policy(config.reference_policy).model if config.kl_coef > 0 and config.reference_policy else None
    value_head = None
    if config.algorithm == "ppo":
        import torch

        value_head = torch.nn.Linear(loaded.model.config.hidden_size, 1)
        if loaded.value_head_state is not None:
            value_head.load_state_dict(loaded.value_head_state)
        else:
            torch.nn.init.zeros_(value_head.weight)
            torch.nn.init.zeros_(value_head.bias)
    trainer = Trainer(
        loaded.model,
        config,
        policy_version=loaded.policy_version,
        value_head=value_head,
        reference=reference,
        optimizer_state=loaded.optimizer_state,
    )
    trees, infos, load_stats = load_trees(lake_root, run_id, iteration, config)
    batch = build_batch(trees, infos, config, policy_version=loaded.policy_version)
    metrics = {f"load/{k}": float(v) for k, v in load_stats.items()}
    metrics.update(trainer.step(batch))
    new_version = loaded.policy_version + 1
    path = save_checkpoint(
        out_dir,
        policy_version=new_version,
        model=trainer.model,
        tokenizer=loaded.tokenizer,
        optimizer=trainer.optimizer,
        value_head=trainer.value_head,
        meta={
            "parent": str(loaded.path),
            "run_id": run_id,
            "iteration": int(iteration),
            "config": config.model_dump(mode="json"),
        },
    )
    metrics["policy_version"] = float(new_version)
    published = None
    if config.publish_url:
        if admin_token is None:
            from clawpipe.config import get_settings

            admin_token = get_settings().admin()
        published = publish(
            config.publish_url, path, new_version, token=admin_token, timeout_s=config.publish_timeout_s
        )
    if tracker is not None:
        tracker.log_metrics({f"train/{k}": v for k, v in metrics.items()}, step=int(iteration))
    log.info(
        "train step done run_id=%s iteration=%s policy_version=%d loss=%.4f",
        run_id,
        iteration,
        new_version,
        metrics.get("loss/total", float("nan")),
    )
    return TrainResult(path, new_version, metrics, published)
