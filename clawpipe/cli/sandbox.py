"""``clawpipe rollout`` (run harnesses on tasks in sandboxes) and ``clawpipe harness list|check|install``."""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import typer

logger = logging.getLogger(__name__)
# Written into a harness's .venv by `harness install`: the sha256 of the requirements it was built from.
PACKAGES_STAMP = ".clawpipe-requirements.sha256"

harness_app = typer.Typer(help="Inspect harness manifests (harnesses/<name>/harness.toml).", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(harness_app, name="harness")

    @app.command("rollout")
    def rollout(
        harness: str = typer.Option(..., "--harness", help="Harness name (harnesses/<name>) or a harness folder."),
        tasks: str = typer.Option(None, "--tasks", help="Task set name to generate instances from."),
        n: int = typer.Option(4, "-n", "--n", help="Number of task instances."),
        samples: int = typer.Option(1, "--samples", "-k", help="Rollouts per task instance (the GRPO group size)."),
        task_file: Path | None = typer.Option(
            None, "--task-file", help="JSON/JSONL task instances to run instead of generating them."
        ),
        backend: str = typer.Option("bwrap", "--backend", help="bwrap (default), docker, or process (no isolation)."),
        concurrency: int = typer.Option(8, "--concurrency", "-c", help="Rollouts running at once."),
        proxy: str = typer.Option("http://127.0.0.1:8400", "--proxy", help="The capture proxy's URL."),
        model: str = typer.Option("policy", "--model", help="Served model name the harness is told to use."),
        run_id: str = typer.Option("adhoc", "--run-id", help="Run the calls and rows are attributed to."),
        iteration: int = typer.Option(0, "--iteration", help="Iteration number within the run."),
        seed: int = typer.Option(0, "--seed", help="Seed for task generation."),
        split: str = typer.Option("train", "--split", help="Task split: train or eval."),
        timeout: float | None = typer.Option(None, "--timeout", help="Seconds per rollout (default: the manifest's)."),
        results: Path | None = typer.Option(
            None,
            "--results",
            help="Results JSONL (default <home>/captures/results/<run>/<iter>/results-<batch>.jsonl).",
        ),
        harness_dir: list[Path] = typer.Option([], "--harness-dir", help="Extra folder holding <name>/harness.toml."),
        keep_workdirs: bool = typer.Option(False, "--keep-workdirs", help="Keep each rollout's work dir."),
        max_attempts: int = typer.Option(3, "--max-attempts", help="Tries per rollout for infra errors only."),
        env: list[str] = typer.Option(
            [],
            "--env",
            "-e",
            help="KEY=VALUE set over the manifest's \\[env] for this run (repeatable), e.g. CLAWPIPE_CLI_MODE=full.",
        ),
    ) -> None:
        """Run a harness on tasks in sandboxes against the proxy; one result row per rollout."""
        import datetime as dt
        import secrets

        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.table import Table

        from clawpipe.cli import check_run_id
        from clawpipe.errors import ConfigError
        from clawpipe.sandbox import RolloutSpec, find_harness, load_task_file, masked_groups, run_rollouts
        from clawpipe.sandbox.manifest import default_harness_dirs

        check_run_id(run_id, "--run-id")  # before any sandbox starts, not as each rollout's failure
        dirs = [*harness_dir, *default_harness_dirs()]
        manifest = find_harness(harness, dirs)
        if env:
            manifest = manifest.with_env(env_pairs(env))
        task_sets: dict[str, object] = {}
        if task_file is not None:
            instances = load_task_file(task_file)
        else:
            from clawpipe.tasks import get_task_set

            name = tasks or (manifest.task_sets[0] if manifest.task_sets else None)
            if name is None:
                raise ConfigError("give --tasks NAME (the harness declares no task_sets) or --task-file")
            ts = get_task_set(name)
            task_sets[ts.name] = ts
            instances = ts.generate(n, seed, split)
        # each invocation is its own batch, so two calls with one run id (other harnesses, the same tasks)
        # never share a rollout id: <batch>.<harness>.<task>.<sample>
        batch = f"adhoc-{dt.datetime.now(dt.UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
        specs = [
            RolloutSpec(
                run_id=run_id,
                iteration=iteration,
                harness=manifest,
                task=task,
                model=model,
                group_id=f"{batch}.{manifest.name}.{task['task_id']}",
                sample_idx=k,
                eval=split == "eval",
            )
            for task in instances
            for k in range(samples)
        ]
        console = Console(stderr=True)
        counts: dict[str, int] = {}
        with Progress(
            TextColumn("[bold]rollouts"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=console,
        ) as bar:
            job = bar.add_task("", total=len(specs))

            def progress(result: object, done: int, total: int) -> None:
                status = str(result.status)  # type: ignore[attr-defined]
                counts[status] = counts.get(status, 0) + 1
                bar.update(job, completed=done, description=" ".join(f"{k}={v}" for k, v in sorted(counts.items())))

            out = run_rollouts(
                specs,
                proxy_url=proxy,
                backend=backend,
                concurrency=concurrency,
                results_path=results,
                progress=progress,
                task_sets=task_sets,
                harness_dirs=dirs,
                max_attempts=max_attempts,
                keep_workdirs=keep_workdirs,
                timeout_s=timeout,
            )
        table = Table("rollout", "status", "exit", "reward", "calls", "seconds", title=f"{manifest.name} on {backend}")
        for r in out:
            reward = "-" if r.reward is None else f"{r.reward:.3f}"
            table.add_row(r.rollout_id, str(r.status), str(r.exit_code), reward, str(r.n_calls), f"{r.duration_s:.2f}")
        Console().print(table)
        rewards = [r.reward for r in out if r.reward is not None]
        mean = sum(rewards) / len(rewards) if rewards else float("nan")
        masked = masked_groups(out)
        typer.echo(
            f"{len(out)} rollouts: {', '.join(f'{k}={v}' for k, v in sorted(counts.items()))}; "
            f"mean reward {mean:.3f}; masked groups {len(masked)}"
        )
        if any(r.status == "infra_error" for r in out):
            raise typer.Exit(1)


def env_pairs(pairs: list[str]) -> dict[str, str]:
    """``--env KEY=VALUE`` options as a table (the value may hold '='; a later KEY wins)."""
    from clawpipe.errors import ConfigError

    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--env {pair!r}: expected KEY=VALUE, e.g. --env CLAWPIPE_CLI_MODE=full")
        out[key] = value
    return out


@harness_app.command("list")
def harness_list(
    harness_dir: list[Path] = typer.Option([], "--harness-dir", help="Extra folder holding <name>/harness.toml."),
) -> None:
    """List the harnesses found (name, API, task sets, description); invalid manifests are flagged."""
    from clawpipe.errors import ManifestError
    from clawpipe.sandbox import list_harnesses, load_manifest
    from clawpipe.sandbox.manifest import default_harness_dirs

    for path in list_harnesses([*harness_dir, *default_harness_dirs()]):
        try:
            m = load_manifest(path)
            typer.echo(f"{m.name:20} {m.api:10} {','.join(m.task_sets):20} {m.description}")
        except ManifestError as exc:
            typer.secho(f"{path.parent.name:20} INVALID    {exc}", fg="red")


@harness_app.command("check")
def harness_check(
    name: str = typer.Argument(..., help="Harness name or folder."),
    harness_dir: list[Path] = typer.Option([], "--harness-dir", help="Extra folder holding <name>/harness.toml."),
    transcript: Path | None = typer.Option(
        None, "--transcript", help="A sample out/transcript.json to check against each task set's contract."
    ),
    tasks: list[str] = typer.Option([], "--tasks", help="Task set(s) for --transcript (default: the manifest's)."),
) -> None:
    """Validate one manifest and print what the runner will execute; with --transcript, check a sample
    transcript against the transcript contract of each task set the harness plays (exit 1 on a problem)."""
    from clawpipe.sandbox import find_harness
    from clawpipe.sandbox.backends.base import INNER_HARNESS
    from clawpipe.sandbox.manifest import default_harness_dirs
    from clawpipe.sandbox.precheck import command_problems
    from clawpipe.tasks import list_task_sets

    m = find_harness(name, [*harness_dir, *default_harness_dirs()])
    typer.echo(f"{m.name}: ok")
    typer.echo(f"  command (sandbox): {' '.join(m.resolve_command(INNER_HARNESS))}")
    typer.echo(f"  api={m.api} task_sets={list(m.task_sets)} timeout_s={m.timeout_s}")
    typer.echo(f"  memory_mb={m.limits.memory_mb} cpus={m.limits.cpus} pids={m.limits.pids}")
    for p in m.ro_paths:
        typer.echo(f"  ro_path {p} {'(present)' if p.exists() else '(MISSING)'}")
    state = packages_state(m.dir)
    if state is not None:
        typer.echo(f"  packages: {state}")
    problems = command_problems(m)
    for problem in problems:
        typer.secho(f"  cannot start: {problem}", fg="red")
    known = list_task_sets()
    for ts_name in m.task_sets:
        if ts_name not in known and ":" not in ts_name:  # 'package.module:attr' sets are imported when run
            close = difflib.get_close_matches(ts_name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            typer.secho(
                f"  task set {ts_name!r} is neither built in nor registered in this process (known: "
                f"{', '.join(known)}){hint}",
                fg="yellow",
            )
    if transcript is not None:
        failed = [name for name in tasks or m.task_sets if not check_transcript(transcript, name)]
        if failed:
            typer.secho(f"{transcript}: does not follow the transcript contract of {failed}", fg="red")
            raise typer.Exit(1)
    if problems:
        raise typer.Exit(1)


def transcript_contract(task_set: object) -> str:
    """The "Transcript contract" part of the task set's module docstring ('' when it states none): its
    first paragraph and the list items that follow it."""
    doc = getattr(sys.modules.get(type(task_set).__module__), "__doc__", None) or ""
    start = doc.find("Transcript contract")
    if start < 0:
        return ""
    paragraphs = doc[start:].split("\n\n")
    kept = [paragraphs[0]] + [p for p in paragraphs[1:2] if p.lstrip().startswith("- ")]
    return "\n\n".join(kept).strip()


def transcript_problems(data: dict[str, Any], fields: tuple[str, ...] = ("turns", "final")) -> list[str]:
    """Where a transcript breaks the shape the transcript contracts share (clawpipe.tasks module docs):
    ``turns`` one object per model call with ``reply`` (the call's text) and an optional string ``answer``;
    an optional string ``final``. ``fields`` are those the task set reads (its ``transcript_fields``): a
    task set that reads only ``final`` requires it and ignores ``turns``."""
    if "turns" not in fields:
        final = data.get("final")
        return [] if isinstance(final, str) else ["`final` must be a string: the harness's last reply"]
    turns = data.get("turns")
    if not isinstance(turns, list):
        return ["`turns` must be a list with one entry per model call"]
    problems = [] if turns else ["`turns` is empty: it needs one entry per model call"]
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            problems.append(f"turns[{i}] must be an object (verifiers skip anything else)")
            continue
        if not isinstance(turn.get("reply"), str):
            problems.append(f"turns[{i}].reply must be the call's text, a string ('' when it only called tools)")
        if "answer" in turn and not isinstance(turn["answer"], str):
            problems.append(f"turns[{i}].answer must be a string when present (else the reply is read)")
    if "final" in data and not isinstance(data["final"], str):
        problems.append("`final` must be a string when present")
    return problems


def check_transcript(path: Path, task_set_name: str) -> bool:
    """Check the sample transcript at ``path`` against task set ``task_set_name``'s contract and score it on
    one generated instance; prints what it finds and returns whether it follows the contract."""
    import tempfile

    from clawpipe.tasks import get_task_set, read_transcript
    from clawpipe.tasks.check import needs_sandbox

    ts = get_task_set(task_set_name)
    contract = transcript_contract(ts)
    # the contract's first paragraph, whole: its first line alone stopped mid-sentence
    summary = " ".join(contract.split("\n\n")[0].split()) if contract else "no contract stated"
    typer.echo(f"  transcript vs {ts.name}: {summary}")
    if contract.startswith("Transcript contract: none"):
        typer.echo(f"    {ts.name} reads no transcript: nothing to check")
        return True
    with tempfile.TemporaryDirectory(prefix="clawpipe-transcript-") as tmp:
        workdir = Path(tmp)
        [task] = ts.generate(1, 0)
        ts.prepare(task, workdir)
        (workdir / "out").mkdir(exist_ok=True)
        shutil.copyfile(path, workdir / "out" / "transcript.json")
        data, reason = read_transcript(workdir)
        fields = tuple(getattr(ts, "transcript_fields", ("turns", "final")))
        problems = [reason] if data is None else transcript_problems(data, fields)
        for problem in problems:
            typer.secho(f"    {problem}", fg="red")
        if data is not None and not needs_sandbox(ts):  # a verifier that runs work-dir code never runs here
            from clawpipe.config import get_settings
            from clawpipe.errors import VerifierTimeoutError
            from clawpipe.sandbox.verify import within

            try:  # under the rollouts' limit: a hung verifier must not hang the check
                reward, info = within(
                    get_settings().verify_timeout_s, f"{ts.name}'s verifier", lambda: ts.verify(task, workdir)
                )
            except VerifierTimeoutError as exc:
                typer.secho(f"    {exc}", fg="red")
                return False
            typer.echo(f"    on {task['task_id']}: reward {reward:.3f} {json.dumps(info)[:300]}")
    return not problems


def packages_state(folder: Path) -> str | None:
    """How a harness's own environment stands against its requirements.txt; None without one."""
    from clawpipe.sandbox.manifest import HARNESS_VENV, PACKAGES_FILE

    req = folder / PACKAGES_FILE
    if not req.is_file():
        return None
    stamp = folder / HARNESS_VENV / PACKAGES_STAMP
    if not stamp.is_file():
        return f"MISSING: run `clawpipe harness install {folder.name}`"
    if stamp.read_text().strip() != hashlib.sha256(req.read_bytes()).hexdigest():
        return f"STALE ({PACKAGES_FILE} changed): run `clawpipe harness install {folder.name}`"
    return f"{HARNESS_VENV} up to date with {PACKAGES_FILE}"


def harness_folder(name: str, dirs: list[Path]) -> Path:
    """The folder of harness ``name`` (or a folder path), found without validating its manifest: the
    manifest may name the interpreter that `harness install` is about to build."""
    from clawpipe.errors import ManifestError
    from clawpipe.sandbox.manifest import MANIFEST_NAME

    candidates = [Path(name)] if "/" in name else [d / name for d in dirs]
    for folder in candidates:
        if (folder / MANIFEST_NAME).is_file():
            return folder.resolve()
    raise ManifestError(f"no harness {name!r} in {[str(c) for c in candidates]} (a folder with a {MANIFEST_NAME})")


def build_packages(folder: Path, *, force: bool = False) -> bool:
    """Build ``<folder>/.venv`` from ``<folder>/requirements.txt``; False when it is already up to date.

    The environment runs on the project's interpreter and sees the project's packages (the model SDKs) after
    its own, through a .pth file; both are mounted read-only in every sandbox (the harness folder at
    /harness). A failed install leaves no environment behind.
    """
    from clawpipe.errors import ConfigError
    from clawpipe.sandbox.manifest import HARNESS_VENV, PACKAGES_FILE

    req = folder / PACKAGES_FILE
    if not req.is_file():
        raise ConfigError(f"{folder} has no {PACKAGES_FILE}: list the packages the harness imports there")
    digest = hashlib.sha256(req.read_bytes()).hexdigest()
    venv = folder / HARNESS_VENV
    if not force and (venv / PACKAGES_STAMP).is_file() and (venv / PACKAGES_STAMP).read_text().strip() == digest:
        return False
    shutil.rmtree(venv, ignore_errors=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        project_site = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
        # an import line, so that the project's own .pth files (editable installs) are processed too
        lines = [f"import site; site.addsitedir({p!r})" for p in project_site]
        (venv / "lib" / version / "site-packages" / "_clawpipe_project.pth").write_text("\n".join(lines) + "\n")
        pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install"]
        proc = subprocess.run(
            [*pip, "--no-input", "--disable-pip-version-check", "-r", str(req)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise ConfigError(f"pip could not install {req} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        (venv / PACKAGES_STAMP).write_text(digest + "\n")
    except BaseException:
        shutil.rmtree(venv, ignore_errors=True)
        raise
    logger.info("built %s from %s", venv, req)
    return True


@harness_app.command("install")
def harness_install(
    name: str = typer.Argument(..., help="Harness name or folder."),
    harness_dir: list[Path] = typer.Option([], "--harness-dir", help="Extra folder holding <name>/harness.toml."),
    force: bool = typer.Option(False, "--force", help="Rebuild even when up to date."),
) -> None:
    """Build the harness's own packages (requirements.txt -> .venv in its folder, git-ignored, read-only in
    the sandbox); its manifest then runs ``.venv/bin/python``. A no-op when up to date."""
    from clawpipe.sandbox import find_harness
    from clawpipe.sandbox.manifest import default_harness_dirs

    dirs = [*harness_dir, *default_harness_dirs()]
    folder = harness_folder(name, dirs)
    built = build_packages(folder, force=force)
    m = find_harness(str(folder), dirs)  # the manifest is valid now that its interpreter exists
    typer.echo(f"{m.name}: {'built' if built else 'up to date:'} {packages_state(folder)}")
