"""The pipeline flow: for each iteration rollout -> land -> reconstruct -> train -> publish -> evaluate.

With ``mode = "async"`` the flow runs flows/async_loop.py's producer and trainer subflows at once instead.

Run it with ``clawpipe run`` (or ``python -m flows.pipeline``). Each stage is a Prefect task around a
plain library function of clawpipe.pipeline.stages, with retries and timeouts declared here; each
iteration is a subflow named ``<run_id>-it<N>``; per-iteration artifacts hold the reward per harness and
a summary naming the MLflow run and the tree rendering.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from clawpipe.config import get_settings, prepare_environment
from clawpipe.configfile import read_config
from clawpipe.errors import ClawpipeError

SETTINGS = prepare_environment()  # offline-safe Prefect/MLflow settings before either is imported

from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.artifacts import create_markdown_artifact, create_table_artifact  # noqa: E402
from prefect.cache_policies import INPUTS, TASK_SOURCE  # noqa: E402
from prefect.client.schemas.objects import State  # noqa: E402
from prefect.exceptions import TerminationSignal  # noqa: E402
from prefect.runtime import flow_run, task_run  # noqa: E402
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings  # noqa: E402
from prefect.states import Cancelled  # noqa: E402

from clawpipe.pipeline import fanout, overlap, report, stages  # noqa: E402
from clawpipe.pipeline.config import PipelineConfig  # noqa: E402
from clawpipe.pipeline.faults import inject_fault  # noqa: E402
from clawpipe.pipeline.monitor import PeakMemory  # noqa: E402
from clawpipe.pipeline.services import publish  # noqa: E402
from clawpipe.pipeline.state import run_lock, run_of_flow_run  # noqa: E402
from clawpipe.pipeline.train_worker import close_worker  # noqa: E402
from flows.cancel import CancelWatch  # noqa: E402

# --- tasks: one library call each, retries declared here and nowhere else -------------------------------


ROLLOUT_RETRIES = 2


@task(name="rollout_batch", retries=ROLLOUT_RETRIES, retry_delay_seconds=[2, 10], timeout_seconds=3600)
def rollout_batch(
    cfg: PipelineConfig, run_id: str, iteration: int, policy_version: int, proxy_url: str, evaluation: bool = False
) -> dict[str, Any]:
    """Run this iteration's rollouts (or held-out evaluation) in sandboxes through the proxy."""
    specs = stages.sample_specs(cfg, run_id, iteration, policy_version=policy_version, evaluation=evaluation)
    kind = "eval" if evaluation else "rollout"
    progress = stages.progress_logger(get_run_logger(), f"it {iteration} {kind}", len(specs))

    def on_result(result: Any, done: int, total: int) -> None:
        if not evaluation and done == max(1, total // 2):
            inject_fault("rollout_batch", iteration)  # half the batch has written its results
        progress(result, done, total)

    if cfg.rollout_pool:  # shards as flow runs on the pool's workers (flows/rollout_shard.py)
        from flows.rollout_shard import fan_out_batch

        done = fan_out_batch(
            cfg, specs, proxy_url=proxy_url, batch_id=f"{kind}-{iteration}", halt=overlap.halt_event(run_id)
        )
    else:
        done = stages.run_rollouts(
            cfg,
            specs,
            proxy_url=proxy_url,
            settings=get_settings(),
            batch_id=f"{kind}-{iteration}",
            progress=on_result,
            final_attempt=task_run.run_count > ROLLOUT_RETRIES,
            halt=overlap.halt_event(run_id),  # async mode: the batch runs in a worker thread
        )
    get_run_logger().info("it %d %s: reward %.3f, statuses %s", iteration, kind, done["reward_mean"], done["statuses"])
    return done


@task(name="land_batch", retries=3, retry_delay_seconds=[1, 5, 20], timeout_seconds=1800)
def land_batch(iteration: int) -> dict[str, Any]:
    """Land new capture records and rollout results into the lake (idempotent)."""
    landed = fanout.land_run(get_settings())  # from the object store's capture prefix when the lake is there
    get_run_logger().info("it %d landed %s", iteration, {k: v for k, v in landed.items() if isinstance(v, int)})
    inject_fault("land_batch", iteration)
    return landed


@task(
    name="reconstruct_batch", retries=2, retry_delay_seconds=1, cache_policy=INPUTS + TASK_SOURCE, timeout_seconds=1800
)
def reconstruct_batch(run_id: str, iteration: int, fingerprint: str) -> dict[str, Any]:
    """Rebuild the iteration's prefix trees; cached on the landed inputs so a retry redoes nothing."""
    trees = stages.reconstruct(get_settings(), run_id, iteration)
    counts = {k: trees.get(k) for k in ("n_trees", "unique_tokens", "flattened_tokens")}
    get_run_logger().info("it %d trees %s", iteration, counts)
    inject_fault("reconstruct_batch", iteration)
    return trees


@task(name="train_policy", retries=1, retry_delay_seconds=10, timeout_seconds=7200)
def train_policy(
    cfg: PipelineConfig, run_id: str, iteration: int, policy_dir: str, mlflow_run_id: str
) -> dict[str, Any]:
    """One training step in its own process; writes checkpoint v+1 and logs to the run's MLflow run."""
    settings = get_settings()
    out_dir = settings.runs_dir / run_id / "checkpoints"
    t0 = time.perf_counter()
    trained = stages.train(
        cfg, settings, run_id, iteration, policy_dir=Path(policy_dir), out_dir=out_dir, mlflow_run_id=mlflow_run_id
    )
    metrics = trained.get("metrics", {})
    get_run_logger().info(
        "it %d trained: loss %.4f, entropy %.3f, checkpoint v%d (%.1f s)",
        iteration,
        metrics.get("loss/total", float("nan")),
        metrics.get("entropy", float("nan")),
        int(trained["policy_version"]),
        time.perf_counter() - t0,
    )
    return trained


@task(name="publish_policy", retries=2, retry_delay_seconds=5, timeout_seconds=900)
def publish_policy(services: dict[str, str], checkpoint: str, policy_version: int, engine: str) -> int:
    """Reload the serving engine with the new checkpoint; the proxy stamps the new version."""
    publish(
        services["serving_url"],
        services["proxy_url"],
        get_settings().admin(),
        Path(checkpoint),
        policy_version,
        engine=engine,
        served_dir=Path(services["served_dir"]),
    )
    get_run_logger().info("published policy_version %d", policy_version)
    return policy_version


@task(name="report_iteration")
def report_iteration(run_id: str, summary: dict[str, Any], mlflow_run_id: str, example: dict[str, Any]) -> None:
    """Log the iteration's metrics to MLflow and publish its reward table and summary as artifacts."""
    from clawpipe.tracking import make_tracker

    tracker = make_tracker(bool(mlflow_run_id))  # no MLflow run when the store was away as the run started
    tracker.start_run(mlflow_run_id=mlflow_run_id)
    tracker.log_metrics(report.iteration_metrics(summary), step=summary["iteration"])
    key = f"{report.slug(run_id)}-it{summary['iteration']}"
    create_table_artifact(key=f"reward-{key}", table=report.reward_rows(summary), description=f"Reward, {key}")
    markdown = report.iteration_markdown(run_id, summary, mlflow_run_id, example)
    create_markdown_artifact(key=f"summary-{key}", markdown=markdown, description=f"Iteration summary, {key}")


# --- flows ------------------------------------------------------------------------------------------


def _iteration_name() -> str:
    p = flow_run.parameters
    return f"{p['run_id']}-it{p['iteration']}"


@flow(name="iteration", flow_run_name=_iteration_name, log_prints=False)
def iteration_flow(
    cfg: PipelineConfig, run_id: str, iteration: int, state: dict[str, Any], services: dict[str, str]
) -> dict[str, Any]:
    """One iteration: rollout, land, reconstruct, train, publish, evaluate, report."""
    t0 = time.perf_counter()
    policy_dir, version, mlflow_run_id = state["policy_dir"], state["policy_version"], state["mlflow_run_id"]
    rollouts = rollout_batch(cfg, run_id, iteration, version, services["proxy_url"])
    land_batch(iteration)
    trees = reconstruct_batch(run_id, iteration, stages.landed_fingerprint(get_settings(), run_id, iteration))
    example = stages.render_example_tree(get_settings(), run_id, iteration, tokenizer_dir=Path(policy_dir))
    trained = train_policy(cfg, run_id, iteration, policy_dir, mlflow_run_id)
    version = publish_policy(services, trained["checkpoint"], int(trained["policy_version"]), cfg.engine)
    evaluation = None
    if stages.evaluates(cfg, iteration):
        evaluation = rollout_batch(cfg, run_id, iteration, version, services["proxy_url"], evaluation=True)
        land_batch(iteration)
    summary = report.iteration_summary(
        iteration,
        rollouts=rollouts,
        trees=trees,
        trained=trained,
        policy_version=version,
        evaluation=evaluation,
        seconds=time.perf_counter() - t0,
    )
    report_iteration(run_id, summary, mlflow_run_id, example)
    return summary


def _pipeline_name() -> str:
    p = flow_run.parameters
    return str(p.get("run_id") or "pipeline")


@flow(name="pipeline", flow_run_name=_pipeline_name, log_prints=False)
def pipeline(
    cfg: PipelineConfig | None = None, run_id: str | None = None, resume: bool = False
) -> dict[str, Any] | State:
    """Iterations of rollout -> land -> reconstruct -> train -> publish, then a summary.

    Cancelled through Prefect (flows/cancel.py) or terminated, it stops its services and sandboxes, ends
    its MLflow run as KILLED (FAILED on an error) and leaves the run to ``clawpipe run --resume``."""
    logger = get_run_logger()
    settings = get_settings()
    this_run = str(flow_run.id) if flow_run.id else None
    if not run_id and this_run and (started := run_of_flow_run(settings.runs_dir, this_run)):
        # this flow run started that run before its worker or host died, and was retried: go on with it
        # rather than start another run from the initial policy
        logger.info("flow run %s started run %s already: resuming it", this_run, started)
        run_id, resume = started, True
    with contextlib.ExitStack() as held:
        # held by this flow too, not only by `clawpipe run`: a deployment's run (a worker runs this function)
        # of a run id another process is running is refused, not run a second time
        if run_id:
            held.enter_context(run_lock(settings.runs_dir, run_id, reentrant=True))
        state = stages.open_run(
            settings, cfg, run_id=run_id, resume=resume, git_revision=_git_revision(), flow_run_id=this_run
        )
        held.enter_context(run_lock(settings.runs_dir, state.run_id, reentrant=True))
        return _drive(PipelineConfig.model_validate(state.config), state, settings, logger)


def _drive(cfg: PipelineConfig, state: Any, settings: Any, logger: Any) -> dict[str, Any] | State:
    """The run's iterations, watched for a cancel; ended in MLflow when stopped early."""
    watch = CancelWatch(flow_run.id)
    try:
        with watch:
            return _iterate(cfg, state, settings, logger)
    except (TerminationSignal, KeyboardInterrupt):
        stages.end_tracking(cfg, state, "KILLED")
        if not watch.requested:
            raise
        message = f"cancelled; continue it with `clawpipe run --resume {state.run_id}`"
        logger.info("run %s %s", state.run_id, message)
        watch.settle(f"run {state.run_id} {message}")
        return Cancelled(message=f"run {state.run_id} {message}")
    except BaseException:
        stages.end_tracking(cfg, state, "FAILED")
        raise
    finally:
        close_worker(state.run_id)  # the run's training process, on every way out


def _iterate(cfg: PipelineConfig, state: Any, settings: Any, logger: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    # The subflows below run in this flow's process, whose own run heartbeats. Without heartbeats of their
    # own they end at once: Prefect's heartbeat thread sleeps in whole seconds and every sync flow run waits
    # for it at its end (~1 s per iteration, train step and evaluation subflow).
    quiet_subflows = temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})
    with quiet_subflows, PeakMemory() as memory, stages.run_services(cfg, settings, state) as services:
        if cfg.mode == "async":
            from flows.async_loop import run_async

            logger.info("== async: producer and trainer from iteration %d of %d", state.next_iteration, cfg.iterations)
            run_async(cfg, state, services.endpoints(), memory)
        for iteration in range(state.next_iteration, cfg.iterations):
            logger.info("== iteration %d/%d of %s", iteration + 1, cfg.iterations, state.run_id)
            summary = iteration_flow(cfg, state.run_id, iteration, state.position(), services.endpoints())
            state.complete(summary, peak_memory_mb=memory.peak_mb)
            state.save(settings.runs_dir)
        state.peak_memory_mb = max(state.peak_memory_mb, memory.peak_mb)
        close_worker(state.run_id)  # the run's training process, while the memory monitor still sees it
    state.save(settings.runs_dir)
    result = report.final_summary(state, time.perf_counter() - t0)
    stages.log_run_end(cfg, state, result)
    create_markdown_artifact(key=f"run-{report.slug(state.run_id)}", markdown=result["markdown"])
    return result


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
    """Entry point of ``clawpipe run``, which validates the config once and hands it over as a file."""
    parser = argparse.ArgumentParser(prog="python -m flows.pipeline", description=__doc__)
    parser.add_argument("--config-file", help="validated PipelineConfig (written by clawpipe.configfile)")
    parser.add_argument("--run-id", required=True, help="the run's id (new, or the one to resume)")
    parser.add_argument("--resume", action="store_true", help="continue the run from its last completed iteration")
    parser.add_argument("--summary-out", help="write the final summary JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with contextlib.ExitStack() as held:
        try:
            cfg = read_config(PipelineConfig, args.config_file, what="pipeline config") if args.config_file else None
            held.enter_context(run_lock(SETTINGS.runs_dir, args.run_id))  # one process per run, to the end
        except ClawpipeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        final = pipeline(cfg=cfg, run_id=args.run_id, resume=args.resume, return_state=True)
        if final.is_cancelled():
            print(f"error: {final.message}", file=sys.stderr)
            return 1
        result: dict[str, Any] = final.result()  # type: ignore[assignment]  # raises what failed the run
        print(result["markdown"])
        if args.summary_out:
            Path(args.summary_out).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
