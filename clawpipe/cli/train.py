"""``clawpipe train``: one training step on an iteration's trees (imports torch only when run).

With ``--nproc N`` (or ``nproc`` in the config) this process starts torch.distributed's elastic launcher,
which runs N ranks of this same command (clawpipe.train.launch); a rank sees WORLD_SIZE and trains its share.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import typer


def register(app: typer.Typer) -> None:
    app.command("train", help="Train the policy on one iteration's prefix trees and write checkpoint v+1.")(train)


def train(
    run: str = typer.Option(..., "--run", "--run-id", help="Run id whose trees to train on."),
    iteration: int = typer.Option(..., "--iteration", help="Iteration whose trees to train on."),
    config: Path | None = typer.Option(None, "--config", help="TOML training config (TrainConfig fields)."),
    policy: Path | None = typer.Option(
        None, "--policy", help="Policy directory to start from; default: the newest checkpoint in --out."
    ),
    out: Path | None = typer.Option(None, "--out", help="Checkpoint directory; default <home>/models/<run>."),
    publish_url: str | None = typer.Option(None, "--publish-url", help="Serving engine URL to reload the checkpoint."),
    track: bool = typer.Option(True, "--track/--no-track", help="Log params and metrics to MLflow."),
    mlflow_run_id: str | None = typer.Option(
        None, "--mlflow-run-id", help="Log into this existing MLflow run (the pipeline's) instead of a new one."
    ),
    metrics_out: Path | None = typer.Option(
        None, "--metrics-out", help="Write {checkpoint, policy_version, metrics} as JSON here."
    ),
    nproc: int | None = typer.Option(
        None, "--nproc", help="Ranks per node (torch.distributed, FSDP2); default: the config's nproc (1)."
    ),
    nnodes: int | None = typer.Option(
        None, "--nnodes", help="Nodes; run the same command on each (needs --rdzv-endpoint)."
    ),
    rdzv_endpoint: str | None = typer.Option(
        None, "--rdzv-endpoint", help="HOST:PORT of the rendezvous on the first node (multi-node)."
    ),
) -> None:
    from clawpipe.cli import check_run_id
    from clawpipe.config import prepare_environment
    from clawpipe.errors import ConfigError
    from clawpipe.tracking import make_tracker
    from clawpipe.train.config import load_config
    from clawpipe.train.step import train_step

    check_run_id(run, "--run")  # it names the checkpoint folder <home>/models/<run> too
    settings = prepare_environment()
    cfg = load_config(config, publish_url=publish_url, nproc=nproc, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint)
    out_dir = out or settings.models_dir / run
    policy_dir = policy or _newest_checkpoint(out_dir)
    if policy_dir is None:
        raise ConfigError(f"no checkpoint in {out_dir}: pass --policy DIR (e.g. one made by `clawpipe model init`)")
    rank = int(os.environ.get("RANK", "0"))
    if cfg.nproc * cfg.nnodes > 1 and "WORLD_SIZE" not in os.environ:
        done = _launch(cfg, run, iteration, policy_dir, out_dir, metrics_out, mlflow_run_id, track)
        _summary(done["metrics"], done["policy_version"], Path(done["checkpoint"]), cfg.max_tokens_per_micro_batch)
        return
    tracker = make_tracker(track and rank == 0)  # one rank tracks a distributed step
    if mlflow_run_id:
        tracker.start_run(mlflow_run_id=mlflow_run_id)
    else:
        tracker.start_run(f"{run}-train-{iteration}", tags={"clawpipe.run_id": run, "clawpipe.stage": "train"})
    tracker.log_params({f"train.{k}": v for k, v in cfg.flat_params().items()} if mlflow_run_id else cfg.flat_params())
    try:
        result = train_step(
            run,
            iteration,
            lake_root=settings.lake_dir,
            policy_dir=policy_dir,
            out_dir=out_dir,
            config=cfg,
            tracker=tracker,
        )
    except BaseException:
        tracker.end("FAILED")
        raise
    if not mlflow_run_id:
        tracker.end()
    if "WORLD_SIZE" in os.environ:
        from clawpipe.train.distributed import shutdown

        shutdown()
        if rank != 0:
            # nothing left to do: leave without the interpreter's teardown of torch's C++ state, which can
            # abort a rank after a clean step (SIGABRT at exit, and the launcher fails the step)
            import logging

            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    m = result.metrics
    if metrics_out is not None:
        import json

        metrics_out.write_text(
            json.dumps(
                {"checkpoint": str(result.checkpoint_dir), "policy_version": result.policy_version, "metrics": m},
                default=float,
            )
        )
    _summary(m, result.policy_version, result.checkpoint_dir, cfg.max_tokens_per_micro_batch)


def _launch(
    cfg: Any,
    run: str,
    iteration: int,
    policy_dir: Path,
    out_dir: Path,
    metrics_out: Path | None,
    mlflow_run_id: str | None,
    track: bool,
) -> dict[str, Any]:
    """Run this step as cfg.nproc ranks under torch.distributed.run; rank 0's result."""
    from clawpipe.configfile import write_config
    from clawpipe.train.launch import launcher_command, run_distributed, step_arguments

    staging = out_dir / ".launch"
    cfg_file = write_config(cfg, staging / f"train-{run}-{iteration}.json")  # every rank reads the same config
    metrics_file = metrics_out or staging / f"metrics-{run}-{iteration}.json"
    args = step_arguments(
        run,
        iteration,
        config=cfg_file,
        policy=policy_dir,
        out=out_dir,
        metrics_out=metrics_file,
        mlflow_run_id=mlflow_run_id,
        track=track,
    )
    command = launcher_command(
        cfg.nproc, nnodes=cfg.nnodes, rdzv_endpoint=cfg.rdzv_endpoint, rdzv_id=f"{run}-{iteration}"
    )
    return run_distributed(command + args, metrics_file)


def _summary(m: dict[str, float], version: int, checkpoint: Path, target: int) -> None:
    typer.echo(
        f"policy_version {version} -> {checkpoint}\n"
        f"loss {m.get('loss/total', float('nan')):.4f}  reward {m.get('reward/mean', float('nan')):.3f}  "
        f"tokens {int(m.get('tokens/flattened', 0))} flattened / {int(m.get('tokens/unique', 0))} unique  "
        f"{m.get('time/step_s', 0):.2f} s\n"
        f"micro-batches {int(m.get('micro_batches', 0))}, largest {int(m.get('tokens/largest_micro_batch', 0))} tokens "
        f"(target {target}; a longer path gets a micro-batch of its own)"
        + (
            f"\nranks {int(m['dist/world_size'])}, balance {m.get('dist/balance', 1.0):.2f}"
            if "dist/world_size" in m
            else ""
        )
    )


def _newest_checkpoint(out_dir: Path) -> Path | None:
    found = []
    for p in out_dir.glob("policy-v*"):
        suffix = p.name.removeprefix("policy-v")
        if p.is_dir() and suffix.isdigit():
            found.append((int(suffix), p))
    return max(found)[1] if found else None
