"""What the runner checks before any sandbox starts, so that a bad batch fails whole and at once.

:func:`check_specs` loads each spec's harness manifest and validates its task, the manifest's read-only
paths and task sets, that its command can start (:func:`command_problems`), and the run and rollout ids (no
two rollouts of one iteration may share an id: their rows and folders would collide). :func:`check_proxy`
makes sure something listens at the proxy's address.
clawpipe/sandbox/runner.py calls both before it starts the batch.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from clawpipe.errors import ConfigError, ManifestError, SandboxError
from clawpipe.sandbox.bridge import parse_proxy_url
from clawpipe.sandbox.manifest import HarnessManifest, find_harness, validate_task
from clawpipe.sandbox.rollout import RolloutSpec


def check_specs(specs: list[RolloutSpec], harness_dirs: list[Path] | None) -> dict[int, HarnessManifest]:
    """Validate every spec (manifest, task, ids) before anything runs; return the manifest per spec index."""
    cache: dict[str, HarnessManifest] = {}
    out: dict[int, HarnessManifest] = {}
    seen: set[tuple[str, int, str]] = set()
    checked: set[str] = set()
    for i, spec in enumerate(specs):
        if isinstance(spec.harness, HarnessManifest):
            manifest = spec.harness
        else:
            if spec.harness not in cache:
                cache[spec.harness] = find_harness(spec.harness, harness_dirs)
            manifest = cache[spec.harness]
        validate_task(spec.task, f"rollout {i} task")
        for ro in manifest.ro_paths:
            if not ro.exists():
                raise ManifestError(
                    f"harness {manifest.name!r} needs {ro} (sandbox.ro_paths) but it does not exist; install it first"
                )
        if manifest.name not in checked:
            problems = command_problems(manifest)
            if problems:
                raise ManifestError(f"harness {manifest.name!r} cannot start: {problems[0]}")
            checked.add(manifest.name)
        if manifest.task_sets and spec.task["task_set"] not in manifest.task_sets:
            raise ManifestError(
                f"harness {manifest.name!r} supports task sets {list(manifest.task_sets)}, "
                f"not {spec.task['task_set']!r} (add it to task_sets in its harness.toml)"
            )
        for name, value in (("run_id", spec.run_id), ("rollout_id", spec.id)):
            if not value or "/" in value or "\x1f" in value or value.startswith("."):
                raise ConfigError(f"rollout {i}: {name}={value!r} must be non-empty, without '/', not start with '.'")
        ident = (spec.run_id, spec.iteration, spec.id)
        if ident in seen:
            raise ConfigError(
                f"rollout {i}: duplicate rollout id {spec.id!r} in run {spec.run_id} iteration {spec.iteration}"
            )
        seen.add(ident)
        out[i] = manifest
    return out


def check_proxy(proxy_url: str, timeout_s: float = 3.0) -> None:
    """Fail fast, before any sandbox starts, when nothing listens at the proxy's address."""
    host, port = parse_proxy_url(proxy_url)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise SandboxError(
            f"nothing answers at the proxy {proxy_url} ({exc}); start it first (clawpipe proxy --upstream URL)"
        ) from exc


# Programs that take a script file as their first argument that is not an option.
_INTERPRETERS = frozenset({"python", "python3", "node", "bash", "sh", "dash", "ruby", "perl", "deno", "bun", "tsx"})
_VALUE_OPTIONS = frozenset({"-X", "-W", "-r", "--require", "--import", "--loader", "--experimental-loader"})
_CODE_OPTIONS = frozenset({"-c", "-m", "-e", "--eval", "-p", "--print"})  # code or a module instead of a script
_SANDBOX_PATH = ("/usr/local/bin", "/usr/bin", "/bin")  # after the Python environment's bin (harness_env)


def command_problems(manifest: HarnessManifest) -> list[str]:
    """Why the manifest's command could not start in a sandbox on this host; empty when it can.

    Without this a harness whose program is missing runs every rollout to a ``failed`` status (the exec
    fails inside the sandbox) and the run learns nothing. Checked: a bare program name is on the
    sandbox's PATH (the Python environment's bin, then /usr/local/bin, /usr/bin, /bin); a program named by
    a path exists and is executable; an interpreter's script (its first argument that is not an option) is
    a file in the harness folder or at its absolute path.
    """
    problems: list[str] = []
    first = manifest.command[0]
    where = f"{manifest.dir / 'harness.toml'} command"
    if "/" not in first:
        dirs = [str(Path(sys.prefix) / "bin"), *_SANDBOX_PATH]
        if not any(os.access(Path(d) / first, os.X_OK) for d in dirs):
            problems.append(
                f"{where}: program {first!r} is not on the sandbox's PATH ({':'.join(dirs)}); install it, name it by "
                "its absolute path, or put it in the harness folder and write ./" + first
            )
    else:
        program = Path(first) if first.startswith("/") else manifest.dir / first
        if not program.is_file() or not os.access(program, os.X_OK):
            state = "is not executable (chmod +x it)" if program.is_file() else "does not exist"
            problems.append(f"{where}: program {str(program)!r} {state}")
    if Path(first).name in _INTERPRETERS or Path(first).name.startswith("python3."):
        script, flags, args = None, set(), iter(manifest.command[1:])
        for arg in args:
            if not arg.startswith("-"):
                script = arg
                break
            flags.add(arg)
            if arg in _VALUE_OPTIONS:
                next(args, None)
        if script is not None and not flags & _CODE_OPTIONS:
            target = Path(script) if script.startswith("/") else manifest.dir / script
            if not target.is_file():
                problems.append(
                    f"{where}: {Path(first).name} would run {script!r}, which is not a file in {manifest.dir}"
                    if not script.startswith("/")
                    else f"{where}: {Path(first).name} would run {script!r}, which does not exist"
                )
    return problems
