"""``clawpipe train``: one training step on an iteration's trees (imports torch only when run)."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("train", help="Train the policy on one iteration's prefix trees and write checkpoint v+1.")(train)


def train(
    run: str = typer.Option(..., "--run", help="Run id whose trees to train on."),
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
) -> None:
    from clawpipe.config import prepare_environment
    from clawpipe.errors import ConfigError
    from clawpipe.tracking import make_tracker
    from clawpipe.train.config import load_config
    from clawpipe.train.step import train_step

    settings = prepare_environment()
    cfg = load_config(config, publish_url=publish_url)
    out_dir = out or settings.models_dir / run
    policy_dir = policy or _newest_checkpoint(out_dir)
    if policy_dir is None:
        raise ConfigError(f"no checkpoint in {out_dir}: pass --policy DIR (e.g. one made by `clawpipe model init`)")
    tracker = make_tracker(track)
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
    m = result.metrics
    if metrics_out is not None:
        import json

        metrics_out.write_text(
            json.dumps(
                {"checkpoint": str(result.checkpoint_dir), "policy_version": result.policy_version, "metrics": m},
                default=float,
            )
        )
    typer.echo(
        f"policy_version {result.policy_version} -> {result.checkpoint_dir}\n"
        f"loss {m.get('loss/total', float('nan')):.4f}  reward {m.get('reward/mean', float('nan')):.3f}  "
        f"tokens {int(m.get('tokens/flattened', 0))} flattened / {int(m.get('tokens/unique', 0))} unique  "
        f"{m.get('time/step_s', 0):.2f} s\n"
        f"micro-batches {int(m.get('micro_batches', 0))}, largest {int(m.get('tokens/largest_micro_batch', 0))} tokens "
        f"(target {cfg.max_tokens_per_micro_batch}; a longer path gets a micro-batch of its own)"
    )


def _newest_checkpoint(out_dir: Path) -> Path | None:
    found = []
    for p in out_dir.glob("policy-v*"):
        suffix = p.name.removeprefix("policy-v")
        if p.is_dir() and suffix.isdigit():
            found.append((int(suffix), p))
    return max(found)[1] if found else None
