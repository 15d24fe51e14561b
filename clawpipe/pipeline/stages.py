"""The stages of one iteration as plain functions (flows/ wires them into Prefect tasks).

rollout -> land -> reconstruct -> train -> publish, plus greedy evaluation. Each stage writes its own
partition or file, so a stage retried after a partial write leaves exactly-once data: rollout results are
keyed by rollout id (the latest attempt wins at landing), landing is idempotent by call id, tree and
training outputs replace their partition or checkpoint directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clawpipe.config import Settings
from clawpipe.errors import ConfigError, SandboxError, TreeError
from clawpipe.pipeline import provenance
from clawpipe.pipeline.config import PipelineConfig
from clawpipe.pipeline.services import Services
from clawpipe.pipeline.state import RunState, new_run_id
from clawpipe.pipeline.training import make_train_config, start_trainer, train

__all__ = ["make_train_config", "start_trainer", "train"]  # the training stage, re-exported for flows/

log = logging.getLogger(__name__)


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()[:4], "little")


def open_run(
    settings: Settings,
    cfg: PipelineConfig | None,
    *,
    run_id: str | None,
    resume: bool,
    git_revision: str,
    flow_run_id: str | None = None,
) -> RunState:
    """The run's state: loaded to resume, or new (initial policy built, MLflow run started, config logged as
    params and as a ``config.toml`` artifact, what the run used beyond its config as tags: see provenance.py).

    Either way the prerequisites (harnesses, task sets, sandbox tool) are checked before anything starts.
    A new run records ``flow_run_id``, the Prefect flow run that started it (see state.run_of_flow_run).
    """
    from clawpipe.tracking import make_tracker

    if resume:
        if not run_id:
            raise ConfigError("resume needs the run id to continue")
        state = RunState.load(settings.runs_dir, run_id)
        log.info("resuming run %s at iteration %d", run_id, state.next_iteration)
        resumed = PipelineConfig.model_validate(state.config)
        check_prerequisites(resumed)
        changed = provenance.changed_on_resume(resumed, state.provenance, state.run_id, state.next_iteration)
        if state.mlflow_run_id:  # the same MLflow run goes on: RUNNING again after a kill or a cancel
            tracker = make_tracker(experiment=resumed.experiment)
            tracker.start_run(mlflow_run_id=state.mlflow_run_id)
            tracker.mark_running()
            if changed:  # said in the run's record too: its curve may bend here for this reason
                tracker.set_tags({f"clawpipe.changed_on_resume.it{state.next_iteration}": ", ".join(changed)})
        return state
    cfg = cfg or PipelineConfig()
    if run_id and (settings.runs_dir / run_id / "state.json").is_file():  # a new run must not overwrite a run
        raise ConfigError(f"run {run_id} exists already; continue it with --resume {run_id}, or start a new run")
    check_prerequisites(cfg)
    run_id = run_id or new_run_id(cfg.run_name)
    policy_dir = ensure_policy(cfg, settings)
    record, diff = provenance.record(cfg, policy_dir, git_revision)  # hashed once, here, for the whole run
    state = RunState(
        run_id=run_id, config=cfg.model_dump(), policy_dir=str(policy_dir), flow_run_id=flow_run_id, provenance=record
    )
    config_toml = provenance.config_toml(cfg, record, run_id)
    (settings.runs_dir / run_id).mkdir(parents=True, exist_ok=True)
    (settings.runs_dir / run_id / "config.toml").write_text(config_toml)
    tracker = make_tracker(experiment=cfg.experiment)
    run_tags = {"clawpipe.run_id": run_id, "git": git_revision, **provenance.tags(record)}
    run_tags |= provenance.location_tags(settings.lake_dir, settings.runs_dir / run_id, flow_run_id)
    state.mlflow_run_id = tracker.start_run(run_id, tags=run_tags)
    # the trainer's settings whole (defaults included, as the trainer logs them): runs of configs that set
    # different train keys still have the same param names, and the same values for the same settings
    train_params = make_train_config(cfg).flat_params()
    tracker.log_params(
        {"run_id": run_id, **cfg.model_dump(exclude={"train"}), "train": train_params, "git_revision": git_revision}
    )
    tracker.log_text(config_toml, "config.toml")  # `clawpipe run --config` of it runs the same config again
    if diff and len(diff.encode()) <= provenance.MAX_DIFF_BYTES:  # the uncommitted changes the run ran with
        tracker.log_text(diff, "git.diff")
    elif diff:
        log.info("the checkout's changes are over %d bytes: not stored, only their hash", provenance.MAX_DIFF_BYTES)
    state.save(settings.runs_dir)
    return state


def run_services(cfg: PipelineConfig, settings: Settings, state: RunState) -> Services:
    """The run's engine and proxy (a context manager), serving the state's current policy."""
    return Services(
        policy_dir=Path(state.policy_dir),
        capture_dir=settings.captures_dir,
        log_dir=settings.runs_dir / state.run_id / "logs",
        admin_token=settings.admin(),
        served_name=cfg.served_name,
        policy_version=state.policy_version,
        engine=cfg.engine,
        serve_host=cfg.serve_host,
    )


def log_run_end(cfg: PipelineConfig, state: RunState, result: dict[str, Any]) -> None:
    """Close the run's MLflow run with its peak memory, wall time and final policy."""
    from clawpipe.tracking import make_tracker

    tracker = make_tracker(bool(state.mlflow_run_id), experiment=cfg.experiment)
    tracker.start_run(mlflow_run_id=state.mlflow_run_id)
    metrics = {"run/peak_memory_mb": state.peak_memory_mb, "run/seconds": result["seconds"]}
    tracker.log_metrics(metrics, step=cfg.iterations)
    tracker.log_text(result["markdown"], "summary.md")  # the reward table and per-harness totals, as printed
    # the trained policy, to serve or to start another run from (policy = "<dir>")
    tracker.set_tags(
        {"clawpipe.final_policy.dir": state.policy_dir, "clawpipe.final_policy.version": str(state.policy_version)}
    )
    tracker.end()


def end_tracking(cfg: PipelineConfig, state: RunState, status: str) -> None:
    """End the run's MLflow run as ``status`` (KILLED, FAILED) when the run stops early, so it does not show
    as RUNNING for ever; a resume marks it RUNNING again."""
    from clawpipe.tracking import make_tracker

    if state.mlflow_run_id:
        tracker = make_tracker(experiment=cfg.experiment)
        tracker.start_run(mlflow_run_id=state.mlflow_run_id)
        tracker.end(status)


def evaluates(cfg: PipelineConfig, iteration: int) -> bool:
    """Whether held-out evaluation runs after this iteration (every ``eval_every``, and after the last)."""
    last = iteration == cfg.iterations - 1
    return bool(cfg.eval_tasks) and (iteration % cfg.eval_every == 0 or last)


def progress_logger(logger: Any, label: str, total: int) -> Callable[[Any, int, int], None]:
    """A rollout progress callback that logs about four lines per batch, naming the last result."""
    step = max(1, total // 4)

    def progress(result: Any, done: int, total: int) -> None:
        if done % step == 0 or done == total:
            status = getattr(result.status, "value", result.status)
            logger.info("%s %d/%d (last: %s %s reward=%s)", label, done, total, result.harness, status, result.reward)

    return progress


def check_prerequisites(cfg: PipelineConfig) -> None:
    """Fail before anything starts when a harness, task set or sandbox tool is missing."""
    import shutil

    from clawpipe.sandbox.manifest import find_harness
    from clawpipe.tasks import get_task_set

    for h in cfg.harnesses:
        manifest = find_harness(h.name)
        get_task_set(h.task_set)
        if h.task_set not in manifest.task_sets:
            raise ConfigError(
                f"harnesses: {h.name} does not support task set {h.task_set!r}; it supports {manifest.task_sets}"
            )
    if cfg.backend == "bwrap" and shutil.which("bwrap") is None:
        raise ConfigError("backend bwrap needs bubblewrap: apt-get install -y bubblewrap, or set backend = 'process'")
    if cfg.backend == "docker" and shutil.which("dockerd") is None and not os.environ.get("DOCKER_HOST"):
        raise ConfigError("backend docker needs a Docker engine (apt-get install -y docker.io) or DOCKER_HOST")


def ensure_policy(cfg: PipelineConfig, settings: Settings) -> Path:
    """The initial policy: the configured directory, or the default tiny policy, built on first use."""
    if cfg.policy:
        path = Path(cfg.policy).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(f"policy: {path} has no config.json; give a saved transformers model directory")
        return path
    path = settings.models_dir / f"default-{cfg.policy_size}-seed{cfg.seed}"
    if not (path / "config.json").is_file():
        log.info("building the default %s policy at %s", cfg.policy_size, path)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "clawpipe",
                "model",
                "init",
                str(path),
                "--size",
                cfg.policy_size,
                "--seed",
                str(cfg.seed),
            ],
            check=True,
            capture_output=True,
        )
    return path


def sample_specs(
    cfg: PipelineConfig, run_id: str, iteration: int, *, policy_version: int, evaluation: bool = False
) -> list[Any]:
    """RolloutSpecs for one iteration: groups x samples per harness (train), or one greedy rollout per
    held-out task per harness (evaluation, marked eval so training never sees it)."""
    from clawpipe.sandbox.manifest import find_harness
    from clawpipe.sandbox.rollout import RolloutSpec
    from clawpipe.tasks import get_task_set

    specs = []
    for h in cfg.harnesses:
        task_set = get_task_set(h.task_set)
        harness: Any = find_harness(h.name).with_env(h.env) if h.env else h.name
        if evaluation:
            tasks = task_set.generate(cfg.eval_tasks, seed=cfg.seed, split="eval")
            # one greedy rollout and eval_samples at the task's own temperature, as groups of their own
            modes = [("eval.greedy.", 1, {"temperature": 0.0}), ("eval.sampled.", cfg.eval_samples, {})]
        else:
            tasks = task_set.generate(h.groups or cfg.groups, seed=_seed(cfg.seed, iteration, h.name), split="train")
            modes = [("", cfg.samples, {})]
        for task in tasks:
            for prefix, samples, sampling in modes:
                run_task = {**task, "sampling": {**task.get("sampling", {}), **sampling}} if sampling else task
                # unique across runs and iterations (a task can be drawn again later), so rollout ids
                # (<group_id>.<sample>) join across tables and runs without the run id or iteration
                group_id = f"{prefix}{run_id}.it{iteration}.{h.name}.{task['task_id']}"
                for k in range(samples):
                    specs.append(
                        RolloutSpec(
                            run_id=run_id,
                            iteration=iteration,
                            harness=harness,
                            task=run_task,
                            model=cfg.served_name,
                            group_id=group_id,
                            sample_idx=k,
                            policy_version=policy_version,
                            eval=evaluation,
                        )
                    )
    return specs


def run_rollouts(
    cfg: PipelineConfig,
    specs: list[Any],
    *,
    proxy_url: str,
    settings: Settings,
    batch_id: str,
    progress: Callable[[Any, int, int], None] | None = None,
    final_attempt: bool = True,
    halt: threading.Event | None = None,
) -> dict[str, Any]:
    """Run the specs in sandboxes through the proxy; return counts and rewards per harness. ``halt``: see
    :func:`clawpipe.sandbox.runner.run_rollouts` (set when an async run stops).

    Retries live in one place, the caller's (the flow's task retries): the runner tries each rollout once,
    and when some hit infra errors (a sandbox that would not start, a proxy path that was down) this raises
    after every result is written, unless ``final_attempt``; the retry then reruns only those rollouts.

    Retry-safe (a Prefect retry, or a resumed run after a kill): a rollout that already has a final result
    row in this batch's results file is not run again. One that was cut off has calls captured under its
    old rollout id but no result row; on attempt N > 1 of the batch (counted on disk) it runs again as
    ``<id>.a<N>`` in the same GRPO group, so the cut-off calls never mix into the new rollout's tree (they
    stay in ``model_calls``; the ``calls_without_rollout`` audit leaves out an attempt that ran again).
    """
    import dataclasses

    from clawpipe.capture import read_results
    from clawpipe.pipeline.attempts import AttemptCounter, plan
    from clawpipe.sandbox.runner import default_results_path
    from clawpipe.sandbox.runner import run_rollouts as run

    if not specs:
        return summarize_results([])
    first = specs[0]
    results_path = default_results_path(first.run_id, first.iteration, batch_id, settings.captures_dir)
    attempt = AttemptCounter(results_path.with_suffix(".attempts")).next()
    done: dict[str, dict[str, Any]] = {}
    if results_path.is_file():
        for _, row, _ in read_results(results_path):
            if row and row.get("status") != "infra_error":
                done[str(row["rollout_id"])] = row
    kept_rows, todo_ids = plan([s.id for s in specs], done, attempt)  # the .a<N> rule, shared with shards
    by_id = {s.id: s for s in specs}
    todo = [by_id[sid] if rid == sid else dataclasses.replace(by_id[sid], rollout_id=rid) for sid, rid in todo_ids]
    kept = list(kept_rows.values())
    if kept:
        log.info("batch %s attempt %d: %d rollouts already done, %d to run", batch_id, attempt, len(kept), len(todo))
    options: dict[str, Any] = {"batch_id": batch_id, "halt": halt}
    if cfg.rollout_timeout_s:
        options["timeout_s"] = cfg.rollout_timeout_s
    results = run(
        todo,
        proxy_url=proxy_url,
        backend=cfg.backend,
        concurrency=cfg.concurrency,
        results_path=results_path,
        progress=progress,
        max_attempts=1,
        **options,
    )
    rows = [r.to_row() for r in results]
    infra = [row["rollout_id"] for row in rows if str(row["status"]) == "infra_error"]
    if infra and not final_attempt:
        raise SandboxError(
            f"batch {batch_id}: {len(infra)} of {len(rows)} rollouts hit infra errors (first: {infra[0]}); "
            "their results are written, and retrying the batch reruns only them"
        )
    return summarize_results(kept + rows)


def summarize_results(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean reward, rollouts and statuses per harness (failed rollouts count with reward 0); for evaluation
    batches also the mean per mode (``greedy``, ``sampled``: the second part of an ``eval.`` group id)."""
    rewards: dict[str, list[float]] = defaultdict(list)
    by_mode: dict[str, list[float]] = defaultdict(list)
    statuses: dict[str, int] = defaultdict(int)
    for row in rows:
        statuses[str(getattr(row["status"], "value", row["status"]))] += 1
        if row["status"] != "infra_error":
            reward = float(row["reward"] or 0.0)
            rewards[row["harness"]].append(reward)
            group = str(row.get("group_id") or "")
            if group.startswith("eval."):
                by_mode[group.split(".")[1]].append(reward)
    by_harness = {h: {"n": len(v), "reward_mean": sum(v) / len(v)} for h, v in rewards.items()}
    every = [x for v in rewards.values() for x in v]
    return {
        "n": len(rows),
        "reward_mean": sum(every) / len(every) if every else 0.0,
        "by_harness": by_harness,
        "by_mode": {m: sum(v) / len(v) for m, v in by_mode.items()},
        "statuses": dict(statuses),
    }


def landed_fingerprint(settings: Settings, run_id: str, iteration: int) -> str:
    """Names and sizes of the iteration's landed call and rollout files: the cache key of reconstruction
    (listed through the lake's filesystem, so an object-store lake has one too)."""
    import posixpath

    import pyarrow.fs as pafs

    from clawpipe.tables import LakeFS, partition_rel

    lake = LakeFS(settings.lake_dir)
    parts = []
    for table in ("model_calls", "rollouts"):
        where = pafs.FileSelector(lake.full(partition_rel(table, run_id, iteration)), allow_not_found=True)
        infos = lake.fs.get_file_info(where)
        parts += sorted(
            f"{posixpath.basename(i.path)}:{i.size}"
            for i in infos
            if i.type == pafs.FileType.File and i.path.endswith(".parquet")
        )
    return ";".join(parts)


def reconstruct(settings: Settings, run_id: str, iteration: int) -> dict[str, Any]:
    """Rebuild the iteration's prefix trees (replaces its tree partitions)."""
    from dataclasses import asdict

    from clawpipe.trees import build_trees

    (summary,) = build_trees(settings.lake_dir, run_id, iteration)
    return asdict(summary)


def render_example_tree(
    settings: Settings, run_id: str, iteration: int, *, tokenizer_dir: Path, out_dir: Path | None = None
) -> dict[str, Any]:
    """Render the iteration's most branched rollout tree: text (for the artifact) and one HTML file."""
    from clawpipe.sqlfiles import sql_text
    from clawpipe.tables import connect
    from clawpipe.trees.render import load_decoder, render_html, render_text

    # the iteration's own files: a connection over the whole lake opens every tree file of the run at its start
    con = connect(settings.lake_dir, tables=("tree_stats", "tree_nodes"), partition=(run_id, int(iteration)))
    params = {"run_id": run_id, "iteration": int(iteration)}
    try:
        rows = con.sql(sql_text("pipeline/example_tree"), params=params).fetchall()
        if not rows:
            return {}
        tree_id = str(rows[0][0])
        nodes = con.sql(sql_text("trees/show"), params={**params, "tree_id": tree_id}).to_arrow_table().to_pylist()
    finally:
        con.close()
    if not nodes:
        raise TreeError(f"tree {tree_id!r} of run {run_id} iteration {iteration} has stats but no nodes; rebuild it")
    decode = load_decoder(tokenizer_dir)
    out_dir = out_dir or settings.runs_dir / run_id / "trees"
    out_dir.mkdir(parents=True, exist_ok=True)
    html = out_dir / f"it{iteration}-{tree_id.replace(':', '-')}.html"
    html.write_text(render_html(nodes, decode=decode))
    return {"tree_id": tree_id, "text": render_text(nodes, decode=decode, width=60), "html": str(html)}
