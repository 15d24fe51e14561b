"""Harness manifests (``harnesses/<name>/harness.toml``) and task instance files, parsed and validated.

Everything here fails before any sandbox starts, with a :class:`ManifestError` that names the file, the
field and what is allowed. The manifest format is contract C in docs/ARCHITECTURE.md; see README "Writing a harness".
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from clawpipe.errors import ManifestError
from clawpipe.sandbox.limits import Limits
from clawpipe.tasks.base import validate_task  # the one task check, shared with clawpipe.tasks

MANIFEST_NAME = "harness.toml"
KIT_NAME = "_kit"  # the shared harness library: a folder beside the harness folders (no manifest, never listed)
KIT_ENV = "CLAWPIPE_HARNESS_KIT"  # where the runner tells a harness the kit is (harnesses/_kit/README.md)
# A harness's own packages: `clawpipe harness install NAME` builds HARNESS_VENV in its folder from PACKAGES_FILE.
PACKAGES_FILE = "requirements.txt"
HARNESS_VENV = ".venv"
APIS = ("openai", "anthropic")
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Variables the runner sets for every harness; a manifest may not override them.
RESERVED_ENV = frozenset(
    {
        "OPENAI_BASE_URL",
        "OPENAI_API_KEY",
        "OPENAI_MODEL",
        "ANTHROPIC_BASE_URL",
        "ANTHROPIC_API_KEY",
        "ANTHROPIC_MODEL",
        "CLAWPIPE_MODEL",
        "CLAWPIPE_TASK",
        "CLAWPIPE_WORKDIR",
        "CLAWPIPE_OUTPUT",
        "HOME",
        "PATH",
        "CLAWPIPE_TIMEOUT_S",
        KIT_ENV,
    }
)
_TOP_KEYS = {
    "name",
    "description",
    "api",
    "command",
    "task_sets",
    "timeout_s",
    "files",
    "resources",
    "env",
    "training",
    "sandbox",
}
_SANDBOX_KEYS = {"ro_paths"}
_RESOURCE_KEYS = {"memory_mb", "cpus", "pids", "disk_mb"}
_TRAINING_KEYS = {"exclude_side_calls"}


@dataclass(frozen=True, slots=True)
class HarnessManifest:
    """A validated harness manifest. ``dir`` is the harness folder (mounted read-only at /harness)."""

    name: str
    dir: Path
    command: tuple[str, ...]
    api: str = "openai"
    description: str = ""
    task_sets: tuple[str, ...] = ()
    timeout_s: float = 60.0
    files: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)
    env: Mapping[str, str] = field(default_factory=dict)
    exclude_side_calls: bool = False
    ro_paths: tuple[Path, ...] = ()  # extra host paths bound read-only at the same path (e.g. a node install)

    def with_env(self, env: Mapping[str, str]) -> HarnessManifest:
        """This manifest with ``env`` set over its [env] (validated like [env]), e.g. a CLI harness's mode."""
        return replace(self, env={**self.env, **check_env(dict(env), f"env for harness {self.name!r}")})

    @property
    def kit_dir(self) -> Path | None:
        """The shared harness library beside this harness's folder (``<harnesses>/_kit``), if there is one.

        The backends bind it read-only (at INNER_KIT in sandboxes) and name it in $CLAWPIPE_HARNESS_KIT.
        """
        kit = self.dir.parent / KIT_NAME
        return kit if kit.is_dir() else None

    def resolve_command(self, harness_root: str | Path) -> list[str]:
        """The argv with relative paths that name files in the harness folder rewritten under ``harness_root``.

        ``harness_root`` is where the folder is visible to the harness: /harness in a sandbox, the real
        folder for the process backend. Bare program names (``python3``) are left to PATH.
        """
        out: list[str] = []
        for i, arg in enumerate(self.command):
            candidate = self.dir / arg
            looks_like_path = i > 0 or "/" in arg
            if not arg.startswith("/") and not arg.startswith("-") and looks_like_path and candidate.exists():
                out.append(f"{str(harness_root).rstrip('/')}/{arg.removeprefix('./')}")
            else:
                out.append(arg)
        return out


def _fail(path: Path, msg: str) -> ManifestError:
    return ManifestError(f"{path}: {msg}")


def _expect(path: Path, table: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = table[key]
    if isinstance(value, bool) and kind is not bool and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise _fail(path, f"`{key}` must be {what}, got {value!r}")
    if not isinstance(value, kind):
        raise _fail(path, f"`{key}` must be {what}, got {type(value).__name__} {value!r}")
    return value


def _check_keys(path: Path, table: str, data: Mapping[str, Any], allowed: frozenset[str] | set[str]) -> None:
    """Refuse keys ``table`` does not take, each with its closest allowed key when one is close."""
    unknown = sorted(set(data) - set(allowed))
    if not unknown:
        return
    hints = [
        f"{k} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(k, sorted(allowed), n=1)) else k
        for k in unknown
    ]
    raise _fail(path, f"unknown {table}key(s) {', '.join(hints)}; allowed: {', '.join(sorted(allowed))}")


def parse_manifest(data: Mapping[str, Any], path: Path) -> HarnessManifest:
    """Validate a parsed harness.toml (``path`` is the manifest file, for messages and the harness dir)."""
    _check_keys(path, "", data, _TOP_KEYS)
    for key in ("name", "command"):
        if key not in data:
            raise _fail(path, f"missing required key `{key}`")
    name = _expect(path, data, "name", str, "a string")
    if not _NAME_RE.match(name):
        raise _fail(path, f"`name` {name!r} must be lowercase letters, digits, '-', '_' or '.' (at most 64)")
    if path.parent.name != name:
        raise _fail(path, f"`name` {name!r} must equal its folder name {path.parent.name!r}")
    command = _expect(path, data, "command", list, 'a list of strings like ["python3", "harness.py"]')
    if not command or not all(isinstance(a, str) and a for a in command):
        raise _fail(path, '`command` must be a non-empty list of non-empty strings like ["python3", "harness.py"]')
    api = data.get("api", "openai")
    if api not in APIS:
        raise _fail(path, f"`api` must be one of {list(APIS)}, got {api!r}")
    description = _expect(path, data, "description", str, "a string") if "description" in data else ""
    task_sets: list[str] = []
    if "task_sets" in data:
        task_sets = _expect(path, data, "task_sets", list, "a list of task set names")
        if not all(isinstance(t, str) and t for t in task_sets):
            raise _fail(path, "`task_sets` must be a list of task set names (strings)")
        twice = sorted({t for t in task_sets if task_sets.count(t) > 1})
        if twice:
            raise _fail(path, f"`task_sets` names {', '.join(twice)} more than once; list each task set once")
    timeout_s = 60.0
    if "timeout_s" in data:
        timeout_s = float(_expect(path, data, "timeout_s", (int, float), "a number of seconds"))
        if not 0 < timeout_s <= 86400:
            raise _fail(path, f"`timeout_s` must be in (0, 86400], got {timeout_s}")
    files: list[str] = []
    if "files" in data:
        files = _expect(path, data, "files", list, "a list of paths relative to the harness folder")
        for f in files:
            if not isinstance(f, str) or f.startswith("/") or ".." in Path(f).parts:
                raise _fail(path, f"`files` entry {f!r} must be a relative path inside the harness folder")
            if not (path.parent / f).exists():
                raise _fail(path, f"`files` entry {f!r} does not exist in {path.parent}")
    limits = _parse_resources(path, data.get("resources", {}))
    env = _parse_env(path, data.get("env", {}))
    training = data.get("training", {})
    if not isinstance(training, dict):
        raise _fail(path, "[training] must be a table")
    _check_keys(path, "[training] ", training, _TRAINING_KEYS)
    exclude = training.get("exclude_side_calls", False)
    if not isinstance(exclude, bool):
        raise _fail(path, "`training.exclude_side_calls` must be true or false")
    ro_paths = _parse_sandbox(path, data.get("sandbox", {}))
    manifest = HarnessManifest(
        name=name,
        dir=path.parent.resolve(),
        command=tuple(command),
        api=api,
        description=description,
        task_sets=tuple(task_sets),
        timeout_s=timeout_s,
        files=tuple(files),
        limits=limits,
        env=env,
        exclude_side_calls=exclude,
        ro_paths=ro_paths,
    )
    first = command[0]
    if "/" in first and not first.startswith("/") and not (manifest.dir / first).exists():
        hint = ""
        if Path(first).parts[0] == HARNESS_VENV and (manifest.dir / PACKAGES_FILE).is_file():
            hint = f"; it is built from {PACKAGES_FILE}: run `clawpipe harness install {name}`"
        raise _fail(path, f"`command[0]` {first!r} is not a file in {manifest.dir}{hint}")
    return manifest


def _parse_resources(path: Path, res: Any) -> Limits:
    if not isinstance(res, dict):
        raise _fail(path, "[resources] must be a table with memory_mb, cpus, pids, disk_mb")
    _check_keys(path, "[resources] ", res, _RESOURCE_KEYS)
    d = Limits()
    memory_mb = res.get("memory_mb", d.memory_mb)
    cpus = res.get("cpus", d.cpus)
    pids = res.get("pids", d.pids)
    disk_mb = res.get("disk_mb", d.disk_mb)
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or not 16 <= memory_mb <= 1 << 20:
        raise _fail(path, f"`resources.memory_mb` must be an integer from 16 to 1048576, got {memory_mb!r}")
    if isinstance(cpus, bool) or not isinstance(cpus, int | float) or not 0.01 <= cpus <= 1024:
        raise _fail(path, f"`resources.cpus` must be a number from 0.01 to 1024, got {cpus!r}")
    if isinstance(pids, bool) or not isinstance(pids, int) or not 4 <= pids <= 1 << 20:
        raise _fail(path, f"`resources.pids` must be an integer from 4 up, got {pids!r}")
    if isinstance(disk_mb, bool) or not isinstance(disk_mb, int) or not 1 <= disk_mb <= 1 << 20:
        raise _fail(path, f"`resources.disk_mb` must be an integer from 1 to 1048576 (MiB), got {disk_mb!r}")
    return Limits(memory_mb=memory_mb, cpus=float(cpus), pids=pids, disk_mb=disk_mb)


def _parse_sandbox(path: Path, table: Any) -> tuple[Path, ...]:
    """[sandbox] ro_paths: absolute, or relative to the folder holding harnesses/ (the repository root)."""
    if not isinstance(table, dict):
        raise _fail(path, "[sandbox] must be a table")
    _check_keys(path, "[sandbox] ", table, _SANDBOX_KEYS)
    ro = table.get("ro_paths", [])
    if not isinstance(ro, list) or not all(isinstance(x, str) and x for x in ro):
        raise _fail(path, "`sandbox.ro_paths` must be a list of paths")
    root = path.resolve().parent.parent.parent
    out = []
    for x in ro:
        p = Path(x) if x.startswith("/") else (root / x)
        p = Path(os.path.normpath(p))
        if p == Path("/") or ".." in Path(x).parts:
            raise _fail(path, f"`sandbox.ro_paths` entry {x!r} must name a specific folder, not / or a parent")
        _check_ro_path(path, x, p, root)
        out.append(p)
    return tuple(out)


def ro_roots(repository: Path) -> list[Path]:
    """Where ro_paths may point: the repository holding the harnesses/ folder (unless it is /) and the folders
    in CLAWPIPE_SANDBOX_RO_ROOTS."""
    from clawpipe.config import get_settings

    roots = [repository.resolve()] if repository.resolve() != Path("/") else []
    for entry in get_settings().sandbox_ro_roots.split(":"):
        if entry.strip():
            roots.append(Path(entry.strip()).expanduser().resolve())
    return roots


def _check_ro_path(manifest: Path, entry: str, p: Path, repository: Path) -> None:
    """An ro_path (symlinks resolved, as bwrap binds them) must lie under an allowed root and must not expose the
    clawpipe home: not the home, nothing inside it, none of its parents."""
    from clawpipe.config import get_settings

    real = p.resolve()
    home = get_settings().root
    if real == home or home in real.parents or real in home.parents:
        raise _fail(
            manifest,
            f"`sandbox.ro_paths` entry {entry!r} ({real}) would expose the clawpipe home {home} (captures, lake, "
            "kept work dirs); ro_paths may not be the home, inside it, or one of its parents",
        )
    roots = ro_roots(repository)
    if not any(real == r or r in real.parents for r in roots):
        raise _fail(
            manifest,
            f"`sandbox.ro_paths` entry {entry!r} ({real}) is outside the allowed roots {[str(r) for r in roots]}; "
            "put it under the repository or add its folder to CLAWPIPE_SANDBOX_RO_ROOTS (':'-separated)",
        )


def _parse_env(path: Path, env: Any) -> dict[str, str]:
    return check_env(env, f"{path}: [env]")


def check_env(env: Any, where: str) -> dict[str, str]:
    """A harness environment table, validated: NAME = "value" strings, no name the runner sets itself.

    ``where`` names the table in the error (a manifest's [env], or a pipeline config's harness entry).
    """
    if not isinstance(env, dict):
        raise ManifestError(f'{where} must be a table of NAME = "value" strings')
    out: dict[str, str] = {}
    for k, v in env.items():
        if not isinstance(k, str) or not _ENV_RE.match(k):
            raise ManifestError(f"{where} name {k!r} is not a valid environment variable name")
        if k in RESERVED_ENV:
            raise ManifestError(f"{where} may not set {k}: the runner sets it for every harness")
        if not isinstance(v, str):
            raise ManifestError(f"{where} {k} must be a string, got {type(v).__name__} (quote it)")
        if "\0" in v:  # no process can be started with it: every rollout would fail at launch
            raise ManifestError(f"{where} {k} holds a NUL character; an environment value cannot carry one")
        unknown = sorted({m.group(1) for m in _REF_RE.finditer(v) if m.group(1) and m.group(1) not in RESERVED_ENV})
        if unknown:
            raise ManifestError(
                f"{where} {k} refers to ${{{unknown[0]}}}: a value may refer only to the variables the runner sets "
                f"({', '.join(sorted(RESERVED_ENV))}); write $$ for a literal $"
            )
        out[k] = v
    return out


# ``${NAME}`` in an [env] value: a variable the runner sets (so a harness that reads its endpoint under a name
# of its own gets it, e.g. LLM_BASE = "${OPENAI_BASE_URL}"); ``$$`` is a literal ``$``; a lone ``$`` stays.
_REF_RE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(value: str, runner: Mapping[str, str]) -> str:
    """``value`` with its ``${NAME}`` references to the runner's variables filled in and ``$$`` made ``$``."""
    if "$" not in value:
        return value
    return _REF_RE.sub(lambda m: runner.get(m.group(1), m.group(0)) if m.group(1) else "$", value)


def load_manifest(path: str | Path) -> HarnessManifest:
    """Read and validate one harness.toml (or a harness folder containing one)."""
    p = Path(path)
    if p.is_dir():
        p = p / MANIFEST_NAME
    if not p.is_file():
        raise ManifestError(f"{p}: no harness manifest here; a harness is a folder with a {MANIFEST_NAME}")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{p}: not valid TOML: {exc}") from exc
    return parse_manifest(data, p)


def default_harness_dirs() -> list[Path]:
    """Where harnesses are looked up by default: ./harnesses, then the repository's harnesses/."""
    dirs = [Path.cwd() / "harnesses", Path(__file__).resolve().parents[2] / "harnesses"]
    seen: list[Path] = []
    for d in dirs:
        r = d.resolve()
        if r not in seen:
            seen.append(r)
    return seen


def list_harnesses(dirs: Iterable[str | Path] | None = None) -> list[Path]:
    """Manifest paths found in the harness directories (first directory wins on a name clash)."""
    found: dict[str, Path] = {}
    for d in dirs if dirs is not None else default_harness_dirs():
        for m in sorted(Path(d).glob(f"*/{MANIFEST_NAME}")):
            found.setdefault(m.parent.name, m)
    return [found[k] for k in sorted(found)]


def find_harness(name: str, dirs: Iterable[str | Path] | None = None) -> HarnessManifest:
    """Load the harness called ``name`` (or a path to a harness folder / manifest)."""
    if "/" in name or name.endswith(".toml"):
        return load_manifest(name)
    search = list(dirs) if dirs is not None else default_harness_dirs()
    for d in search:
        m = Path(d) / name / MANIFEST_NAME
        if m.is_file():
            return load_manifest(m)
    known = [p.parent.name for p in list_harnesses(search)]
    raise ManifestError(
        f"no harness named {name!r} in {[str(d) for d in search]}; known: {known or 'none'}. "
        f"Create <dir>/{name}/{MANIFEST_NAME} or pass its parent folder as a harness dir (--harness-dir)"
    )


def load_task_file(path: str | Path) -> list[dict[str, Any]]:
    """Task instances from a JSON file (one object or a list) or a JSONL file; every one validated."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ManifestError(f"{p}: cannot read task file: {exc}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ManifestError(f"{p}:{line}: not UTF-8 (byte {exc.start}); task files are UTF-8 JSON") from exc
    try:
        return _task_instances(p, text)
    except RecursionError as exc:
        raise ManifestError(f"{p}: JSON nested too deep for a task file") from exc


def _task_instances(p: Path, text: str) -> list[dict[str, Any]]:
    tasks: list[Any]
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            tasks = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{p}: not valid JSON: {exc}") from exc
        return [validate_task(t, f"{p}[{i}]") for i, t in enumerate(tasks)]
    try:
        return [validate_task(json.loads(text), str(p))]
    except json.JSONDecodeError:
        pass
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{p}:{lineno}: not valid JSON: {exc.msg} (column {exc.colno})") from exc
        out.append(validate_task(obj, f"{p}:{lineno}"))
    if not out:
        raise ManifestError(f"{p}: no task instances in file")
    return out
