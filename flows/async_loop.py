"""The async loop (``mode = "async"``): a rollout producer flow and a trainer flow running at once.

``rollout-producer`` rolls out batch after batch against whatever policy is published, landing each batch
into the lake; it runs at most max(1, max_staleness) batches ahead of the trainer. ``trainer`` takes batch k
once the lake holds all its groups complete, and runs a ``<run_id>-step<k>`` subflow: reconstruct, count the
calls by staleness, train on the calls at most ``max_staleness`` versions old (the rest dropped and counted),
publish (the proxy lets in-flight calls finish on the old weights and stamps later ones with the new
version). The step's held-out evaluation (a ``<run_id>-eval<k>`` subflow) and its report then run beside
the next step, which trains at once and publishes only once that evaluation's rollouts are done, so an
evaluation never blocks the trainer (nor, through the lookahead, the producer) and never mixes policies.
Both flows are async Prefect subflows of the run's ``pipeline`` flow, gathered on one event loop; their
blocking stages run as the same Prefect tasks as the sync loop's, in worker threads. The run's training
process is started when the trainer starts, so its imports overlap the first batch's rollouts. A killed
run resumes like a sync one: the run state records steps in order once reported, and re-running a batch
skips the rollouts whose result rows exist (docs/ARCHITECTURE.md, "Async mode").
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from clawpipe.config import get_settings
from clawpipe.pipeline import overlap as ov
from clawpipe.pipeline import report, stages
from clawpipe.pipeline.config import PipelineConfig
from clawpipe.pipeline.monitor import PeakMemory
from flows.pipeline import (
    land_batch,
    publish_policy,
    reconstruct_batch,
    report_iteration,
    rollout_batch,
    train_policy,
)

POLL_S = 0.5


def run_async(cfg: PipelineConfig, state: Any, services: dict[str, str], memory: PeakMemory) -> None:
    """Run the producer and the trainer until the trainer has trained every iteration (blocking)."""
    shared = ov.Overlap(cfg=cfg, state=state)
    ov.RUNNING[state.run_id] = (shared, memory)
    try:
        asyncio.run(_both(cfg, state.run_id, state.next_iteration, services))
    finally:
        ov.RUNNING.pop(state.run_id, None)


async def _both(cfg: PipelineConfig, run_id: str, start: int, services: dict[str, str]) -> None:
    shared, _ = ov.RUNNING[run_id]

    async def side(name: str, coro: Any) -> None:
        try:
            await coro
        except Exception as exc:
            shared.stop = shared.stop or f"{name} failed: {exc}"  # the other side stops at its next wait
            raise
        except BaseException:
            # the loop is torn down (a cancel or kill of the run: its tasks are cancelled) or a signal
            # reached this side: the work both sides left in worker threads stops too, before asyncio.run
            # waits for those threads
            shared.halt()
            raise

    results = await asyncio.gather(
        side("rollout producer", rollout_producer(cfg, run_id, start, services)),
        side("trainer", trainer(cfg, run_id, start, services)),
        return_exceptions=True,
    )
    for result in results:
        if isinstance(result, BaseException):
            raise result


def _name(kind: str) -> Any:
    def name() -> str:
        p = flow_run.parameters
        step = f"{p['iteration']}" if "iteration" in p else ""
        return f"{p['run_id']}-{kind}{step}"

    return name


@flow(name="rollout-producer", flow_run_name=_name("producer"), log_prints=False)
async def rollout_producer(cfg: PipelineConfig, run_id: str, start: int, services: dict[str, str]) -> int:
    """Roll out and land batches ``start`` .. iterations-1, each against the policy published when it starts."""
    logger = get_run_logger()
    shared, _ = ov.RUNNING[run_id]
    for batch in range(start, cfg.iterations):
        t0 = time.monotonic()
        while not shared.may_start(batch):
            shared.check()
            await asyncio.sleep(POLL_S)
        shared.check()
        waited = time.monotonic() - t0
        shared.producer_wait_s[batch] = waited
        version = shared.policy_version
        logger.info("producer: batch %d at policy_version %d (waited %.1f s for the trainer)", batch, version, waited)
        t0 = time.monotonic()
        await asyncio.to_thread(rollout_batch, cfg, run_id, batch, version, services["proxy_url"])
        shared.span("producer", "rollout", batch, t0)
        t0 = time.monotonic()
        await asyncio.to_thread(land_batch, batch)
        shared.span("producer", "land", batch, t0)
        shared.landed.add(batch)
    return cfg.iterations - start


@flow(name="trainer", flow_run_name=_name("trainer"), log_prints=False)
async def trainer(cfg: PipelineConfig, run_id: str, start: int, services: dict[str, str]) -> int:
    """Train iterations ``start`` .. iterations-1 in order, each once its batch is complete in the lake.

    A step's evaluation and report run beside the next step (``_finish``); the steps are recorded in the
    run state in order, each after the one before it.
    """
    logger = get_run_logger()
    settings = get_settings()
    shared, _ = ov.RUNNING[run_id]
    # the training process imports torch while batch ``start`` rolls out, not after it landed
    await asyncio.to_thread(stages.start_trainer, cfg, settings, run_id)
    previous: asyncio.Task[None] | None = None
    try:
        for iteration in range(start, cfg.iterations):
            t0 = time.monotonic()
            rows = None
            while rows is None:
                rows = await asyncio.to_thread(ov.take_batch, shared, settings, run_id, iteration)
                if rows is None:
                    await asyncio.sleep(POLL_S)
            shared.span("trainer", "take", iteration, t0)  # from the previous step's return to this batch taken
            waits = {"trainer_wait_s": time.monotonic() - t0, "producer_wait_s": shared.producer_wait_s.get(iteration)}
            logger.info("trainer: batch %d complete in the lake (waited %.1f s)", iteration, waits["trainer_wait_s"])
            step = await asyncio.to_thread(train_step, cfg, run_id, iteration, shared.position(), services, waits)
            evaluates = stages.evaluates(cfg, iteration)
            if evaluates:
                shared.evaluating()  # before the next step can reach its publish
            previous = asyncio.create_task(_finish(cfg, run_id, step, rows, services, evaluates, previous))
    finally:
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
    if previous is not None:
        previous.result()  # raises what the last steps raised
    return cfg.iterations - start


async def _finish(
    cfg: PipelineConfig,
    run_id: str,
    step: dict[str, Any],
    rollout_rows: list[dict[str, Any]],
    services: dict[str, str],
    evaluates: bool,
    previous: asyncio.Task[None] | None,
) -> None:
    """Evaluate the policy a step published (while the next step trains), then, once the previous step is
    recorded, report the step and record it in the run state."""
    shared, memory = ov.RUNNING[run_id]
    iteration, version = int(step["iteration"]), int(step["policy_version"])
    try:
        evaluation: dict[str, Any] | None = None
        if evaluates:
            t0 = time.monotonic()
            try:
                evaluation = await asyncio.to_thread(evaluate, cfg, run_id, iteration, version, services)
            except BaseException as exc:
                # said before the waiting publish is let go, so the next step stops instead of publishing
                shared.stop = shared.stop or f"step {iteration} failed: {exc}"
                raise
            finally:
                shared.evaluated()
                shared.span("trainer", "evaluate", iteration, t0)
        if previous is not None:
            await previous
        summary = await asyncio.to_thread(  # reads the lake: off the loop both sides share
            report.iteration_summary,
            iteration,
            rollouts=stages.summarize_results(rollout_rows),
            trees=step["trees"],
            trained=step["trained"],
            policy_version=version,
            evaluation=evaluation,
            seconds=time.monotonic() - step["started"],
        )
        summary["overlap"] = {**step["overlap"], "spans": shared.spans_of(iteration)}
        await asyncio.to_thread(report_iteration, run_id, summary, step["mlflow_run_id"], step["example"])
        shared.state.complete(summary, peak_memory_mb=memory.peak_mb)
        shared.state.save(get_settings().runs_dir)  # a resumed run starts after this step
    except BaseException as exc:
        shared.stop = shared.stop or f"step {iteration} failed: {exc}"  # the trainer stops at its next wait
        raise


@flow(name="evaluate", flow_run_name=_name("eval"), log_prints=False)
def evaluate(
    cfg: PipelineConfig, run_id: str, iteration: int, policy_version: int, services: dict[str, str]
) -> dict[str, Any]:
    """Held-out evaluation of the policy step ``iteration`` published, beside the next step's training."""
    evaluation = rollout_batch(cfg, run_id, iteration, policy_version, services["proxy_url"], evaluation=True)
    land_batch(iteration)
    return evaluation


@flow(name="train-step", flow_run_name=_name("step"), log_prints=False)
def train_step(
    cfg: PipelineConfig,
    run_id: str,
    iteration: int,
    position: dict[str, Any],
    services: dict[str, str],
    waits: dict[str, float | None],
) -> dict[str, Any]:
    """One async training step on a landed batch: reconstruct, drop stale calls, train, publish (once no
    evaluation of the previous policy is running)."""
    logger = get_run_logger()
    settings = get_settings()
    shared = ov.RUNNING[run_id][0]
    shared.check()  # a step started while the run stops: nothing to do
    started = time.monotonic()
    policy_dir, version, mlflow_run_id = position["policy_dir"], position["policy_version"], position["mlflow_run_id"]
    stale = ov.staleness(ov.call_ages(settings, run_id, iteration, version), cfg.max_staleness)
    logger.info(
        "step %d at policy_version %d: calls by age %s, %d dropped (older than %d versions)",
        iteration,
        version,
        stale["ages"],
        stale["dropped_calls"],
        cfg.max_staleness,
    )
    trees = reconstruct_batch(run_id, iteration, stages.landed_fingerprint(settings, run_id, iteration))
    example = stages.render_example_tree(settings, run_id, iteration, tokenizer_dir=Path(policy_dir))
    shared.span("trainer", "trees", iteration, started)
    publish_wait = 0.0
    if stale["trained_calls"]:
        t0 = time.monotonic()
        bounded = dict(cfg.train, min_policy_version=max(0, version - cfg.max_staleness))
        trained = train_policy(cfg.model_copy(update={"train": bounded}), run_id, iteration, policy_dir, mlflow_run_id)
        shared.span("trainer", "train", iteration, t0)
        publish_wait = shared.wait_evaluated()  # the previous step's evaluation runs on the policy it evaluates
        t0 = time.monotonic()
        version = publish_policy(services, trained["checkpoint"], int(trained["policy_version"]), cfg.engine)
        shared.span("trainer", "publish", iteration, t0)
    else:  # every call was too stale: nothing to train, the policy stays
        logger.warning("step %d: no call within max_staleness %d; step skipped", iteration, cfg.max_staleness)
        trained = {"checkpoint": policy_dir, "policy_version": version, "metrics": {}}
    shared.published(iteration + 1, version, str(trained["checkpoint"]))  # the producer and next step go on
    overlap = {
        **stale,
        **waits,
        "publish_wait_s": round(publish_wait, 2),
        "trained_from": position["policy_version"],
        "skipped": not stale["trained_calls"],
    }
    return {
        "iteration": iteration,
        "started": started,
        "trees": trees,
        "example": example,
        "trained": trained,
        "policy_version": version,
        "mlflow_run_id": mlflow_run_id,
        "overlap": overlap,
    }
