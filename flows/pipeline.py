"""The pipeline flow: for each iteration rollout -> land -> reconstruct -> train -> publish -> evaluate.

Run it with ``clawpipe run`` (or ``python -m flows.pipeline``). Each stage is a Prefect task around a
plain library function of clawpipe.pipeline.stages, with retries and timeouts declared here; each
iteration is a subflow named ``<run_id>-it<N>``; per-iteration artifacts hold the reward per harness and
a summary naming the MLflow run and the tree rendering.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from clawpipe.config import get_settings, prepare_environment

SETTINGS = prepare_environment()  # offline-safe Prefect/MLflow settings before either is imported

from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.artifacts import create_markdown_artifact, create_table_artifact  # noqa: E402
from prefect.cache_policies import INPUTS, TASK_SOURCE  # noqa: E402
from prefect.runtime import flow_run  # noqa: E402

from clawpipe.pipeline import stages  # noqa: E402
from clawpipe.pipeline.config import PipelineConfig, load_config  # noqa: E402
from clawpipe.pipeline.monitor import PeakMemory  # noqa: E402
from clawpipe.pipeline.services import Services, publish  # noqa: E402
from clawpipe.pipeline.state import RunState, new_run_id  # noqa: E402


def _inject_fault(stage: str, iteration: int) -> None:
    """Fail once at ``stage@iteration`` when CLAWPIPE_INJECT_FAULTS asks for it (retry-idempotence tests)."""
    settings = get_settings()
    wanted = {f.strip() for f in settings.inject_faults.split(",") if f.strip()}
    point = f"{stage}@{iteration}"
    if point not in wanted:
        return
    marker = settings.runs_dir / "faults" / point
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    raise RuntimeError(f"injected fault at {point} (CLAWPIPE_INJECT_FAULTS)")


# --- tasks ------------------------------------------------------------------------------------------


@task(name="rollout_batch", retries=2, retry_delay_seconds=[2, 10], timeout_seconds=3600)
def rollout_batch(
    config: dict[str, Any], run_id: str, iteration: int, policy_version: int, proxy_url: str, evaluation: bool = False
) -> dict[str, Any]:
    """Run this iteration's rollouts (or held-out evaluation) in sandboxes through the proxy."""
    logger = get_run_logger()
    cfg = PipelineConfig.model_validate(config)
    specs = stages.sample_specs(cfg, run_id, iteration, policy_version=policy_version, evaluation=evaluation)
    kind = "eval" if evaluation else "rollout"
    step = max(1, len(specs) // 4)

    def progress(result: Any, done: int, total: int) -> None:
        if not evaluation and done == max(1, total // 2):
            _inject_fault("rollout_batch", iteration)  # half the batch has written its results
        if done % step == 0 or done == total:
            logger.info(
                "it %d %s %d/%d (last: %s %s reward=%s)",
                iteration,
                kind,
                done,
                total,
                result.harness,
                result.status,
                result.reward,
            )

    return stages.run_rollouts(
        cfg,
        specs,
        proxy_url=proxy_url,
        settings=get_settings(),
        batch_id=f"{kind}-{iteration}",
        progress=progress,
    )


@task(name="land_batch", retries=3, retry_delay_seconds=[1, 5, 20], timeout_seconds=1800)
def land_batch(iteration: int) -> dict[str, Any]:
    """Land new capture records and rollout results into the lake (idempotent)."""
    report = stages.land_captures(get_settings())
    _inject_fault("land_batch", iteration)
    return report


def _partition_fingerprint(run_id: str, iteration: int) -> str:
    """Names and sizes of the iteration's landed call files: the cache key of tree reconstruction."""
    root = Path(get_settings().lake_dir)
    parts = []
    for table in ("model_calls", "rollouts"):
        d = root / table / f"run_id={run_id}" / f"iteration={iteration}"
        parts += sorted(f"{p.name}:{p.stat().st_size}" for p in d.glob("*.parquet")) if d.is_dir() else []
    return ";".join(parts)


@task(
    name="reconstruct_batch", retries=2, retry_delay_seconds=1, cache_policy=INPUTS + TASK_SOURCE, timeout_seconds=1800
)
def reconstruct_batch(run_id: str, iteration: int, fingerprint: str) -> dict[str, Any]:
    """Rebuild the iteration's prefix trees; cached on the landed inputs so a retry redoes nothing."""
    summary = stages.reconstruct(get_settings(), run_id, iteration)
    _inject_fault("reconstruct_batch", iteration)
    return summary


@task(name="train_policy", retries=1, retry_delay_seconds=10, timeout_seconds=7200)
def train_policy(
    config: dict[str, Any], run_id: str, iteration: int, policy_dir: str, out_dir: str, mlflow_run_id: str
) -> dict[str, Any]:
    """One training step in its own process; writes checkpoint v+1 and logs to the run's MLflow run."""
    cfg = PipelineConfig.model_validate(config)
    return stages.train(
        cfg,
        get_settings(),
        run_id,
        iteration,
        policy_dir=Path(policy_dir),
        out_dir=Path(out_dir),
        mlflow_run_id=mlflow_run_id,
    )


@task(name="publish_policy", retries=2, retry_delay_seconds=5, timeout_seconds=900)
def publish_policy(
    serving_url: str, proxy_url: str, checkpoint: str, policy_version: int, engine: str, served_dir: str
) -> int:
    """Reload the serving engine with the new checkpoint; the proxy stamps the new version."""
    publish(
        serving_url,
        proxy_url,
        get_settings().admin(),
        Path(checkpoint),
        policy_version,
        engine=engine,
        served_dir=Path(served_dir),
    )
    return policy_version


# --- flows ------------------------------------------------------------------------------------------


def _iteration_name() -> str:
    p = flow_run.parameters
    return f"{p['run_id']}-it{p['iteration']}"


@flow(name="iteration", flow_run_name=_iteration_name, log_prints=False)
def iteration_flow(
    config: dict[str, Any],
    run_id: str,
    iteration: int,
    policy_dir: str,
    policy_version: int,
    serving_url: str,
    proxy_url: str,
    mlflow_run_id: str,
    served_dir: str,
) -> dict[str, Any]:
    """One iteration: rollout, land, reconstruct, train, publish, evaluate; artifacts and metrics."""
    from clawpipe.tracking import make_tracker

    logger = get_run_logger()
    cfg = PipelineConfig.model_validate(config)
    tracker = make_tracker(experiment=cfg.experiment)
    tracker.start_run(mlflow_run_id=mlflow_run_id)
    t0 = time.perf_counter()
    rollouts = rollout_batch(config, run_id, iteration, policy_version, proxy_url)
    logger.info("it %d rollouts: reward %.3f %s", iteration, rollouts["reward_mean"], rollouts["statuses"])
    landed = land_batch(iteration)
    trees = reconstruct_batch(run_id, iteration, _partition_fingerprint(run_id, iteration))
    logger.info(
        "it %d landed %s calls; trees %s, %s/%s unique/flattened tokens",
        iteration,
        landed.get("calls"),
        trees.get("n_trees"),
        trees.get("unique_tokens"),
        trees.get("flattened_tokens"),
    )
    run_dir = Path(get_settings().runs_dir) / run_id
    example = stages.render_example_tree(
        get_settings(), run_id, iteration, tokenizer_dir=Path(policy_dir), out_dir=run_dir / "trees"
    )
    out_dir = run_dir / "checkpoints"
    trained = train_policy(config, run_id, iteration, policy_dir, str(out_dir), mlflow_run_id)
    version = publish_policy(
        serving_url, proxy_url, trained["checkpoint"], int(trained["policy_version"]), cfg.engine, served_dir
    )
    evaluation = None
    last = iteration == cfg.iterations - 1
    if cfg.eval_tasks and (iteration % cfg.eval_every == 0 or last):
        evaluation = rollout_batch(config, run_id, iteration, version, proxy_url, evaluation=True)
        land_batch(iteration)
    summary = {
        "iteration": iteration,
        "reward_mean": rollouts["reward_mean"],
        "by_harness": rollouts["by_harness"],
        "statuses": rollouts["statuses"],
        "eval_reward_mean": evaluation["reward_mean"] if evaluation else None,
        "eval_by_harness": evaluation["by_harness"] if evaluation else None,
        "policy_version": version,
        "policy_dir": trained["checkpoint"],
        "trees": {k: trees.get(k) for k in ("n_trees", "flattened_tokens", "unique_tokens", "drift_count")},
        "train": {
            k: v for k, v in trained.get("metrics", {}).items() if k.startswith(("loss/", "reward/", "kl", "entropy"))
        },
        "seconds": round(time.perf_counter() - t0, 1),
    }
    metrics = {"reward/mean": rollouts["reward_mean"], "iteration/seconds": summary["seconds"]}
    for h, v in rollouts["by_harness"].items():
        metrics[f"reward/{h}"] = v["reward_mean"]
    if evaluation:
        metrics["eval/reward_mean"] = evaluation["reward_mean"]
        for h, v in evaluation["by_harness"].items():
            metrics[f"eval/reward/{h}"] = v["reward_mean"]
    tracker.log_metrics(metrics, step=iteration)
    create_table_artifact(
        key=f"reward-{_slug(run_id)}-it{iteration}",
        table=[
            {"harness": h, "rollouts": v["n"], "reward_mean": round(v["reward_mean"], 4)}
            for h, v in rollouts["by_harness"].items()
        ],
        description=f"Reward per harness, run {run_id}, iteration {iteration}",
    )
    create_markdown_artifact(
        key=f"summary-{_slug(run_id)}-it{iteration}",
        markdown=_iteration_markdown(run_id, summary, tracker, example),
        description=f"Iteration {iteration} of run {run_id}",
    )
    return summary


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower())[:40]


def _iteration_markdown(run_id: str, summary: dict[str, Any], tracker: Any, example: dict[str, Any]) -> str:
    rows = "\n".join(f"| {h} | {v['n']} | {v['reward_mean']:.3f} |" for h, v in summary["by_harness"].items())
    tree = ""
    if example:
        text = "\n".join(example["text"].splitlines()[:40])
        tree = (
            f"## Tree `{example['tree_id']}` (most branched rollout)\n\n```\n{text}\n```\n\n"
            f"HTML: `{example['html']}`; any tree: `clawpipe trees show <tree_id> --format html`.\n"
        )
    return (
        f"# {run_id}, iteration {summary['iteration']}\n\n"
        f"MLflow run: `{getattr(tracker, 'run_id', None)}` (experiment in the MLflow UI)\n\n"
        f"| harness | rollouts | reward |\n|---|---|---|\n{rows}\n\n"
        f"policy_version now {summary['policy_version']}; trees {summary['trees']}.\n\n{tree}"
    )


def _pipeline_name() -> str:
    p = flow_run.parameters
    return str(p.get("run_id") or p.get("resume") or "pipeline")


@flow(name="pipeline", flow_run_name=_pipeline_name, log_prints=False)
def pipeline(
    config: dict[str, Any] | None = None, run_id: str | None = None, resume: str | None = None
) -> dict[str, Any]:
    """Iterations of rollout -> land -> reconstruct -> train -> publish, then a summary."""
    from clawpipe.tracking import make_tracker

    logger = get_run_logger()
    settings = get_settings()
    if resume:
        state = RunState.load(settings.runs_dir, resume)
        cfg = PipelineConfig.model_validate(state.config)
        run_id = state.run_id
        logger.info("resuming run %s at iteration %d", run_id, state.next_iteration)
    else:
        cfg = PipelineConfig.model_validate(config or {})
        run_id = run_id or new_run_id(cfg.run_name)
        state = RunState(run_id=run_id, config=cfg.model_dump(), policy_dir=str(stages.ensure_policy(cfg, settings)))
    stages.check_prerequisites(cfg)
    tracker = make_tracker(experiment=cfg.experiment)
    if state.mlflow_run_id:
        tracker.start_run(mlflow_run_id=state.mlflow_run_id)
    else:
        state.mlflow_run_id = tracker.start_run(run_id, tags={"clawpipe.run_id": run_id, "git": _git_revision()})
        tracker.log_params({"run_id": run_id, **cfg.model_dump(), "git_revision": _git_revision()})
    state.save(settings.runs_dir)
    t0 = time.perf_counter()
    services = Services(
        policy_dir=Path(state.policy_dir),
        capture_dir=settings.captures_dir,
        log_dir=settings.runs_dir / run_id / "logs",
        admin_token=settings.admin(),
        served_name=cfg.served_name,
        policy_version=state.policy_version,
        engine=cfg.engine,
    )
    with PeakMemory() as memory, services:
        for iteration in range(state.next_iteration, cfg.iterations):
            logger.info("== iteration %d/%d", iteration + 1, cfg.iterations)
            summary = iteration_flow(
                cfg.model_dump(),
                run_id,
                iteration,
                state.policy_dir,
                state.policy_version,
                services.serving_url,
                services.proxy_url,
                state.mlflow_run_id,
                str(services.policy_dir),
            )
            state.completed.append(summary)
            state.policy_dir, state.policy_version = summary["policy_dir"], summary["policy_version"]
            state.peak_memory_mb = max(state.peak_memory_mb, memory.peak_mb)
            state.save(settings.runs_dir)
    state.peak_memory_mb = max(state.peak_memory_mb, memory.peak_mb)
    state.save(settings.runs_dir)
    result = final_summary(state, time.perf_counter() - t0)
    tracker.log_metrics(
        {"run/peak_memory_mb": state.peak_memory_mb, "run/seconds": result["seconds"]}, step=cfg.iterations
    )
    tracker.end()
    create_markdown_artifact(key=f"run-{_slug(run_id)}", markdown=result["markdown"], description=f"Run {run_id}")
    return result


def final_summary(state: RunState, seconds: float) -> dict[str, Any]:
    """Reward curve (train and greedy eval), first vs last, peak memory; as dict and markdown."""
    its = state.completed
    lines = ["| iteration | reward (train) | reward (eval, greedy) | per harness |", "|---|---|---|---|"]
    for s in its:
        per = ", ".join(f"{h} {v['reward_mean']:.3f}" for h, v in s["by_harness"].items())
        ev = "" if s.get("eval_reward_mean") is None else f"{s['eval_reward_mean']:.3f}"
        lines.append(f"| {s['iteration']} | {s['reward_mean']:.3f} | {ev} | {per} |")
    first = its[0]["reward_mean"] if its else 0.0
    last = its[-1]["reward_mean"] if its else 0.0
    tail = [s["reward_mean"] for s in its[-3:]]
    last3 = sum(tail) / len(tail) if tail else 0.0

    def ratio(x: float) -> str:
        return f"x{x / first:.2f}" if first else "x inf"

    md = (
        f"# clawpipe run {state.run_id}\n\n" + "\n".join(lines) + "\n\n"
        f"reward first {first:.3f} -> last {last:.3f} ({ratio(last)}; mean of the last 3 iterations "
        f"{last3:.3f}, {ratio(last3)}); "
        f"policy_version {state.policy_version}; peak memory of all processes {state.peak_memory_mb:.0f} MB; "
        f"{seconds:.0f} s. MLflow run {state.mlflow_run_id}.\n"
    )
    return {
        "run_id": state.run_id,
        "first_reward": first,
        "last_reward": last,
        "last3_reward": last3,
        "iterations": its,
        "peak_memory_mb": state.peak_memory_mb,
        "mlflow_run_id": state.mlflow_run_id,
        "seconds": seconds,
        "markdown": md,
    }


def _git_revision() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
            timeout=5,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.pipeline", description=__doc__)
    parser.add_argument("--config", help="pipeline TOML")
    parser.add_argument("--iterations", type=int)
    parser.add_argument("--backend")
    parser.add_argument("--resume", help="run id to continue from its last completed iteration")
    parser.add_argument("--summary-out", help="write the final summary JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = None if args.resume else load_config(args.config, iterations=args.iterations, backend=args.backend)
    result = pipeline(
        config=cfg.model_dump() if cfg else None, run_id=cfg and new_run_id(cfg.run_name), resume=args.resume
    )
    print(result["markdown"])
    if args.summary_out:
        Path(args.summary_out).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
