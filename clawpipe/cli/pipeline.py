"""``clawpipe run``, ``clawpipe deploy`` and ``clawpipe worker``: the main job and its scheduling.

The flows live in flows/ (clawpipe never imports prefect or flows), so these commands validate the
config here, fast, and then run the flow module in a child Python process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from clawpipe.pipeline.config import PipelineConfig


def register(app: typer.Typer) -> None:
    app.command("run", help="Run the pipeline: rollout -> land -> reconstruct -> train -> publish, N iterations.")(run)
    app.command("deploy", help="Register the pipeline as a scheduled Prefect deployment on a Prefect server.")(deploy)
    app.command("worker", help="Start a Prefect worker that executes deployed pipeline runs.")(worker)


def _flows_env() -> dict[str, str]:
    from clawpipe.config import prepare_environment

    prepare_environment()
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run(
    config: Path | None = typer.Option(None, "--config", help="Pipeline TOML (fields of PipelineConfig)."),
    iterations: int | None = typer.Option(None, "--iterations", help="Override the number of iterations."),
    backend: str | None = typer.Option(None, "--backend", help="Override the sandbox backend: bwrap|docker|process."),
    mode: str | None = typer.Option(None, "--mode", help="Override the loop: sync|async (rollouts overlap training)."),
    resume: str | None = typer.Option(None, "--resume", help="Continue RUN_ID from its last completed iteration."),
    summary_out: Path | None = typer.Option(None, "--summary-out", help="Write the final summary JSON here."),
) -> None:
    """Run the main job (the embedded default needs nothing running beforehand)."""
    from clawpipe.config import get_settings
    from clawpipe.configfile import write_config
    from clawpipe.pipeline.config import load_config
    from clawpipe.pipeline.stages import check_prerequisites
    from clawpipe.pipeline.state import new_run_id
    from clawpipe.tracking import check_tracking_uri

    cmd = [sys.executable, "-m", "flows.pipeline"]
    if summary_out is not None:
        _check_summary_out(summary_out)
        cmd += ["--summary-out", str(summary_out)]
    pool = None
    if resume:
        _check_resume(resume, get_settings().runs_dir, config=config, iterations=iterations, backend=backend, mode=mode)
    else:  # validated once here, before anything starts; the flow reads the same model back
        cfg = load_config(config, iterations=iterations, backend=backend, mode=mode)
        check_prerequisites(cfg)
        _check_policy(cfg.policy)
        _warn_changed_since_recorded(config, cfg)
        pool = cfg.rollout_pool
        if pool:  # its shards land in a lake every host shares
            from clawpipe.pipeline.shards import lake_uri_of

            lake_uri_of(get_settings())
    # the services the flow reports to, now rather than after its policy is built and its rollouts ran
    env = _flows_env()
    _check_prefect_api(env, needed_by=f"run with rollout_pool = {pool!r}" if pool else None)
    check_tracking_uri(get_settings().tracking_uri)
    if resume:
        cmd += ["--run-id", resume, "--resume"]
    else:
        run_id = new_run_id(cfg.run_name)
        path = write_config(cfg, get_settings().runs_dir / run_id / "config.json")
        cmd += ["--run-id", run_id, "--config-file", str(path)]
    raise typer.Exit(_run_forwarding_signals(cmd, env))


def _warn_changed_since_recorded(config: Path | None, cfg: PipelineConfig) -> None:
    """A config a run recorded (its ``config.toml`` artifact) runs again, with a warning for each harness,
    task set or policy folder whose content is no longer what that run used: edited on purpose or not, the
    rerun will differ, and only this line says so before it starts."""
    from clawpipe.configfile import read_values
    from clawpipe.pipeline.config import RECORDED_TABLE
    from clawpipe.pipeline.provenance import rerun_warnings

    if config is None:
        return
    recorded = read_values(config, what="config file").get(RECORDED_TABLE)
    if isinstance(recorded, dict):
        for message in rerun_warnings(cfg, recorded):
            typer.secho(f"warning: {message}", err=True, fg="yellow")


def _run_forwarding_signals(cmd: list[str], env: dict[str, str]) -> int:
    """Run the flow process to its end, passing SIGTERM on: a ``kill`` of ``clawpipe run`` alone would
    otherwise leave the flow running on, orphaned, its run still locked. Ctrl-C reaches the flow from the
    terminal itself; this process waits for it to stop rather than exit first."""
    proc = subprocess.Popen(cmd, env=env)
    signal.signal(signal.SIGTERM, lambda signum, _frame: proc.send_signal(signum))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return proc.wait()


def _check_prefect_api(env: dict[str, str], *, needed_by: str | None) -> None:
    """Refuse at once when the Prefect API the child would use does not answer: without this the flow fails
    with a traceback (or, for ``deploy``, registers on a temporary server that is gone when it returns).

    ``needed_by`` names a command that cannot work on a temporary server; ``run`` falls back to one."""
    from clawpipe.errors import ConfigError
    from clawpipe.net import health_failure

    url = env.get("PREFECT_API_URL", "").strip()
    start = "start one with `prefect server start --host 127.0.0.1`"
    if not url:
        if needed_by is None:
            return  # clawpipe run starts a temporary server of its own
        pass_it = "" if needed_by.startswith("run") else "pass --api-url http://127.0.0.1:4200/api or "
        raise ConfigError(
            f"clawpipe {needed_by} needs a running Prefect server: {start}, "
            f"then {pass_it}set PREFECT_API_URL (http://127.0.0.1:4200/api)"
        )
    fallback = "" if needed_by else ", or unset PREFECT_API_URL to run on a temporary server"
    reason = health_failure(url, timeout_s=10)
    if reason is not None:
        raise ConfigError(f"the Prefect API at {url} does not answer ({reason}): {start}{fallback}")


def _check_summary_out(path: Path) -> None:
    """The summary is written after the last iteration; a path it cannot be written to is refused now."""
    from clawpipe.errors import ConfigError

    if path.is_dir():
        raise ConfigError(f"--summary-out {path} is a folder; give a file path such as {path / 'summary.json'}")
    if not path.parent.is_dir():
        raise ConfigError(f"--summary-out {path}: folder {path.parent} does not exist; create it first")
    if not os.access(path.parent, os.W_OK):
        raise ConfigError(f"--summary-out {path}: folder {path.parent} is not writable; choose another path")


def _check_policy(policy: str | None) -> None:
    """A configured initial policy must be a saved model here, where the run's policy server loads it."""
    from clawpipe.errors import ConfigError

    if policy and not (Path(policy).expanduser() / "config.json").is_file():
        raise ConfigError(f"policy: {policy} has no config.json; give a saved transformers model directory")


def _check_resume(run_id: str, runs_dir: Path, **overrides: object) -> None:
    """``--resume`` names a run of this home by its id, checked before the flow starts: a path (``../x``)
    would resume whatever state file it reached, a typo would fail only once Prefect was up.

    A resumed run keeps the config it started with (its later iterations must train like its first), so
    ``--config`` and the overrides are refused rather than silently ignored."""
    from clawpipe.cli import check_run_id
    from clawpipe.errors import ConfigError
    from clawpipe.pipeline.state import RunState, run_lock

    given = [f"--{name}" for name, value in overrides.items() if value is not None]
    if given:
        raise ConfigError(
            f"--resume continues {run_id} with the config it started with; drop {', '.join(given)} "
            f"(its config is {runs_dir / run_id / 'config.json'}), or start a new run without --resume"
        )
    RunState.load(runs_dir, check_run_id(run_id, "--resume"))  # names the known runs when there is no such run
    with run_lock(runs_dir, run_id):  # refused here, before Prefect starts, while another process runs it
        pass


def deploy(
    cron: str | None = typer.Option(None, "--cron", help="Cron schedule, e.g. '0 */6 * * *'."),
    config: Path | None = typer.Option(None, "--config", help="Pipeline TOML the scheduled runs use."),
    pool: str = typer.Option("clawpipe", "--pool", help="Process work pool to deploy to (created if missing)."),
    name: str = typer.Option("clawpipe-pipeline", "--name", help="Deployment name."),
    api_url: str | None = typer.Option(None, "--api-url", help="Prefect server API URL (default: PREFECT_API_URL)."),
) -> None:
    """Needs a Prefect server (`prefect server start --host 127.0.0.1`); an ephemeral one cannot schedule."""
    import tempfile

    from clawpipe.configfile import write_config
    from clawpipe.pipeline.config import load_config
    from clawpipe.pipeline.stages import check_prerequisites

    cfg = load_config(config)
    # harnesses and task sets now, not when the schedule first fires; the sandbox tool is the workers' to have
    check_prerequisites(cfg.model_copy(update={"backend": "process"}))
    _warn_changed_since_recorded(config, cfg)
    env = _flows_env()
    if api_url:
        env["PREFECT_API_URL"] = api_url
    _check_prefect_api(env, needed_by="deploy")
    handoff = write_config(cfg, Path(tempfile.mkdtemp(prefix="clawpipe-deploy-")) / "config.json")
    cmd = [sys.executable, "-m", "flows.deploy", "--pool", pool, "--name", name, "--config-file", str(handoff)]
    if cron:
        cmd += ["--cron", cron]
    raise typer.Exit(subprocess.call(cmd, env=env))


def worker(
    pool: str = typer.Option("clawpipe", "--pool", help="Work pool to take runs from."),
    api_url: str | None = typer.Option(None, "--api-url", help="Prefect server API URL (default: PREFECT_API_URL)."),
    limit: int | None = typer.Option(None, "--limit", min=1, help="Most flow runs at once."),
    run_once: bool = typer.Option(False, "--run-once", help="Execute the runs scheduled now, then exit."),
    slots: int | None = typer.Option(
        None,
        "--slots",
        min=1,
        help="Sandboxes at once on this host over every run: the Prefect limit sandboxes-<host> "
        "(default CLAWPIPE_HOST_SLOTS, else the CPU count).",
    ),
) -> None:
    """Start a process worker for the pool (on this machine or another that shares the lake and MLflow).

    For a rollout pool (``rollout_pool`` in the pipeline config) it first sets this host's sandbox limit;
    on exit it stops the capture proxies that rollout shards started on this host.
    """
    from clawpipe.config import get_settings
    from clawpipe.pipeline.services import stop_host_proxies
    from clawpipe.tracking import check_tracking_uri

    env = _flows_env()
    if api_url:
        env["PREFECT_API_URL"] = api_url
    if slots:
        env["CLAWPIPE_HOST_SLOTS"] = str(slots)
    _check_prefect_api(env, needed_by="worker")
    check_tracking_uri(get_settings().tracking_uri)  # the runs it takes log there
    setup = subprocess.run([sys.executable, "-m", "flows.rollout_shard", "limit"], env=env)
    if setup.returncode != 0:
        raise typer.Exit(setup.returncode)
    cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process"]
    if limit:
        cmd += ["--limit", str(limit)]
    if run_once:
        cmd += ["--run-once"]
    proc = subprocess.Popen(cmd, env=env)
    for sig in (signal.SIGTERM, signal.SIGINT):  # the worker stops first, then this host's proxies
        signal.signal(sig, lambda signum, _frame: proc.send_signal(signum))
    try:
        code = proc.wait()
    finally:
        stop_host_proxies(get_settings().root)
    raise typer.Exit(code)
