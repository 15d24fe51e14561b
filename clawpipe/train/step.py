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

from clawpipe.train import distributed
from clawpipe.train.batch import build_batch
from clawpipe.train.checkpoint import load_policy, publish, save_checkpoint, staging_dir
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
    Under torch.distributed's launcher (WORLD_SIZE > 1) this is one rank of a sharded step
    (clawpipe.train.distributed): rank 0 loads the trees, writes the HF folder, publishes and tracks.
    """
    ctx = distributed.init_from_env(config.device)
    main = ctx is None or ctx.is_main
    loaded = load_policy(policy_dir)
    model, peft_model, lora_base = loaded.model, None, None
    if config.lora_rank:
        from clawpipe.train import lora

        peft_model, lora_base = lora.prepare(loaded, config)
        model = peft_model.get_base_model()  # the same modules, adapters injected; only they take gradients
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
        model,
        config,
        policy_version=loaded.policy_version,
        value_head=value_head,
        reference=reference,
        optimizer_state=loaded.optimizer_state if ctx is None else None,
        dist=ctx,
    )
    if ctx is not None:
        _restore_sharded_optimizer(trainer, loaded.path)
        # one reader of the lake; every rank then builds the same batch (global advantages and normalisers)
        trees, infos, load_stats = distributed.broadcast_object(
            load_trees(lake_root, run_id, iteration, config) if main else None, ctx
        )
    else:
        trees, infos, load_stats = load_trees(lake_root, run_id, iteration, config)
    vocab = int(model.get_input_embeddings().num_embeddings)  # the rows an id may index
    positions = getattr(model.config, "max_position_embeddings", None)
    batch = build_batch(
        trees, infos, config, policy_version=loaded.policy_version, vocab_size=vocab, max_positions=positions
    )
    metrics = {f"load/{k}": float(v) for k, v in load_stats.items()}
    metrics.update(trainer.step(batch))
    new_version = loaded.policy_version + 1
    meta = {
        "parent": str(loaded.path),
        "run_id": run_id,
        "iteration": int(iteration),
        "config": config.model_dump(mode="json"),
    }
    if peft_model is not None and lora_base is not None:
        path = _save_lora(trainer, peft_model, lora_base, out_dir, new_version, loaded, meta)
    elif ctx is None:
        path = save_checkpoint(
            out_dir,
            policy_version=new_version,
            model=trainer.model,
            tokenizer=loaded.tokenizer,
            optimizer=trainer.optimizer,
            value_head=trainer.value_head,
            meta=meta,
        )
    else:
        path = _save_distributed(trainer, ctx, out_dir, new_version, loaded, meta)
    metrics["policy_version"] = float(new_version)
    published = None
    if not main:
        return TrainResult(path, new_version, metrics, None)
    if config.publish_url:
        if admin_token is None:
            from clawpipe.config import get_settings

            admin_token = get_settings().admin()
        published = publish(
            config.publish_url, path, new_version, token=admin_token, timeout_s=config.publish_timeout_s
        )
    if tracker is not None:
        tracker.log_metrics({f"train/{k}": v for k, v in metrics.items()}, step=int(iteration))
    loss = metrics.get("loss/total")
    log.info(
        "train step done run_id=%s iteration=%s policy_version=%d %s",
        run_id,
        iteration,
        new_version,
        f"loss={loss:.4f}" if loss is not None else "empty step: no update (see train/groups_* metrics)",
    )
    return TrainResult(path, new_version, metrics, published)


def _restore_sharded_optimizer(trainer: Trainer, policy_dir: Path) -> None:
    assert trainer.scorer is not None
    if distributed.load_sharded_optimizer(policy_dir / distributed.SHARDED_DIR, trainer.scorer, trainer.optimizer):
        log.info("optimizer state restored from %s", policy_dir / distributed.SHARDED_DIR)
    elif (policy_dir / "optimizer.pt").is_file():
        log.warning(
            "%s holds a single-process optimizer state (optimizer.pt), which a sharded step does not read: "
            "starting a fresh optimizer",
            policy_dir,
        )


def _save_distributed(
    trainer: Trainer, ctx: distributed.DistContext, out_dir: Any, version: int, loaded: Any, meta: dict
) -> Path:
    """Every rank writes its shards into the staging folder; rank 0 adds the plain HF model and renames it."""
    assert trainer.scorer is not None
    staged = Path(distributed.broadcast_object(str(staging_dir(out_dir, version)) if ctx.is_main else None, ctx))
    distributed.save_sharded(staged / distributed.SHARDED_DIR, trainer.scorer, trainer.optimizer)
    state = distributed.full_state(trainer.scorer)  # collective; the tensors land on rank 0
    path = Path(out_dir) / f"policy-v{version}"
    if ctx.is_main:
        model, head_state = distributed.export_model(loaded.model, state)
        head = None
        if head_state:
            import torch

            head = torch.nn.Linear(model.config.hidden_size, 1)
            head.load_state_dict(head_state)
        path = save_checkpoint(
            out_dir,
            policy_version=version,
            model=model,
            tokenizer=loaded.tokenizer,
            optimizer=None,
            value_head=head,
            meta={**meta, "world_size": ctx.world},
            staged=staged,
        )
    distributed.barrier()
    return path


def _save_lora(
    trainer: Trainer, peft_model: Any, base: Path, out_dir: Any, version: int, loaded: Any, meta: dict
) -> Path:
    """The merged model as the HF folder (what the engine reloads), the adapters in adapter/, the base named."""
    from clawpipe.train import lora

    staged = staging_dir(out_dir, version)
    lora.save_adapter(peft_model, staged)
    return save_checkpoint(
        out_dir,
        policy_version=version,
        model=lora.merged_copy(peft_model),
        tokenizer=loaded.tokenizer,
        optimizer=trainer.optimizer,
        value_head=trainer.value_head,
        meta={**meta, "lora_base": str(Path(base).resolve())},
        staged=staged,
    )
