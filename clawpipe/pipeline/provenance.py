"""What a run used beyond its config, recorded once at its start so that MLflow alone can compare it and run
it again.

:func:`record` gathers the run's provenance: the git revision and whether the checkout was dirty, a content
hash of each harness folder (and of the shared harness kit beside them), of each task set's source file and
of the initial policy folder (with where the policy came from: built from config with a seed, or a folder),
and the versions of the libraries that decide what training does. :func:`tags` turns it into MLflow tags
that ``mlflow.search_runs`` filters on (``tags."clawpipe.harnesses" LIKE '%tool-agent%'``).

:func:`config_toml` writes the run's validated config as TOML that ``clawpipe run --config`` accepts
unchanged, with the provenance in a ``[recorded]`` table the config loader leaves out; :func:`changed_since`
compares that table with the folders as they are now, so a rerun whose harness was edited since is told so
(it still runs: harnesses are edited on purpose).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import logging
import math
import os
import platform
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from clawpipe.pipeline.config import RECORDED_TABLE, PipelineConfig

log = logging.getLogger(__name__)

HASH_HEX = 16  # hex digits kept of a sha256: readable in the MLflow UI, far from colliding between runs
# A folder this big (a real policy's weights) has its large files hashed by size and mtime, not read: hashing
# gigabytes at every run start would cost minutes. Harness folders and the tiny policy are read whole.
BIG_FOLDER_BYTES = 64 * 1024 * 1024
LARGE_FILE_BYTES = 4 * 1024 * 1024
MAX_DIFF_BYTES = 1024 * 1024  # a dirty checkout's diff is stored as an artifact up to this size
_SKIPPED_DIRS = frozenset({"__pycache__", ".git", ".mypy_cache", ".pytest_cache", ".ruff_cache"})
_VERSIONED = ("clawpipe", "torch", "transformers", "mlflow", "prefect", "vllm")
_REPO = Path(__file__).resolve().parents[2]
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def folder_digest(folder: Path) -> str:
    """A content hash of ``folder``: every file's relative path, executable bit and bytes (a symlink's
    target, not what it points at); caches (``__pycache__``, ``.git``) are left out. In a folder over
    ``BIG_FOLDER_BYTES`` the files over ``LARGE_FILE_BYTES`` count by size and mtime instead of content."""
    entries: list[tuple[str, os.stat_result, Path]] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for name in filenames:
            if name.endswith((".pyc", ".pyo")):
                continue
            path = Path(dirpath) / name
            entries.append((path.relative_to(folder).as_posix(), path.lstat(), path))
    entries.sort(key=lambda e: e[0])
    big = sum(st.st_size for _, st, _ in entries) > BIG_FOLDER_BYTES
    digest = hashlib.sha256()
    for rel, st, path in entries:
        executable = int(bool(st.st_mode & 0o111))  # a harness command needs its executable bit
        if os.path.islink(path):
            digest.update(f"L\0{rel}\0{os.readlink(path)}\0".encode())
        elif big and st.st_size > LARGE_FILE_BYTES:
            digest.update(f"S\0{rel}\0{executable}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        else:
            digest.update(f"F\0{rel}\0{executable}\0{st.st_size}\0".encode())
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
    if big:
        log.info(
            "%s is over %d MB: its files over %d MB are hashed by size and mtime",
            folder,
            BIG_FOLDER_BYTES >> 20,
            LARGE_FILE_BYTES >> 20,
        )
    return digest.hexdigest()[:HASH_HEX]


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:HASH_HEX]


def harness_digests(cfg: PipelineConfig) -> tuple[dict[str, str], str]:
    """The content hash of each harness folder of ``cfg``, and of the harness kit beside them ("" if none)."""
    from clawpipe.sandbox.manifest import find_harness

    digests: dict[str, str] = {}
    kit = ""
    for h in cfg.harnesses:
        if h.name in digests:
            continue
        manifest = find_harness(h.name)
        digests[h.name] = folder_digest(manifest.dir)
        if not kit and manifest.kit_dir is not None:
            kit = folder_digest(manifest.kit_dir)
    return digests, kit


def task_set_digests(cfg: PipelineConfig) -> dict[str, str]:
    """The hash of the source file that defines each task set of ``cfg`` (its generator and verifier);
    "unknown" where a task set has no source file."""
    from clawpipe.tasks import get_task_set

    out: dict[str, str] = {}
    for name in sorted({h.task_set for h in cfg.harnesses}):
        try:
            source = inspect.getsourcefile(type(get_task_set(name)))
            out[name] = _file_digest(Path(source)) if source else "unknown"
        except (OSError, TypeError):
            out[name] = "unknown"
    return out


def policy_origin(cfg: PipelineConfig, policy_dir: Path) -> dict[str, Any]:
    """Where the initial policy came from (built from config with a seed, or a folder) and its content hash."""
    origin: dict[str, Any] = {"origin": "folder"} if cfg.policy else {"origin": "built", "size": cfg.policy_size}
    if not cfg.policy:
        origin["seed"] = cfg.seed
    origin["dir"] = str(policy_dir)
    origin["sha256"] = folder_digest(policy_dir)
    return origin


def git_state(root: Path = _REPO) -> tuple[str, str]:
    """Whether the checkout at ``root`` has changes against its revision ("true"/"false"/"unknown" where it
    is no git checkout), and the text that says what they are: ``git status`` (untracked files included)
    and ``git diff HEAD``."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30, check=True)
        return out.stdout

    try:
        status = git("status", "--porcelain")
        diff = git("diff", "HEAD") if status else ""
    except (OSError, subprocess.SubprocessError):
        return "unknown", ""
    return ("true" if status else "false"), (status + "\n" + diff if status else "")


def versions() -> dict[str, str]:
    """Versions of python and of the installed libraries that decide what a run does (read from package
    metadata: nothing is imported)."""
    out = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def record(cfg: PipelineConfig, policy_dir: Path, git_revision: str) -> tuple[dict[str, Any], str]:
    """The run's provenance (see the module docstring), and the diff of a dirty checkout ("" if clean)."""
    harnesses, kit = harness_digests(cfg)
    dirty, diff = git_state()
    rec: dict[str, Any] = {
        "git": git_revision,
        "git_dirty": dirty,
        "harnesses": harnesses,
        "harness_kit": kit,
        "task_sets": task_set_digests(cfg),
        "policy": policy_origin(cfg, policy_dir),
        "versions": versions(),
    }
    if diff:
        rec["git_diff_sha256"] = hashlib.sha256(diff.encode()).hexdigest()[:HASH_HEX]
    return rec, diff


def tags(rec: Mapping[str, Any]) -> dict[str, str]:
    """MLflow tags of a provenance record: names to search runs by, then one tag per hash and version."""
    policy = rec["policy"]
    origin = policy["origin"] if policy["origin"] != "built" else f"built {policy['size']} seed {policy['seed']}"
    out = {
        "clawpipe.harnesses": ",".join(sorted(rec["harnesses"])),
        "clawpipe.task_sets": ",".join(sorted(rec["task_sets"])),
        "clawpipe.git_dirty": rec["git_dirty"],
        "clawpipe.policy.origin": origin,
        "clawpipe.policy.dir": policy["dir"],
        "clawpipe.policy.sha256": policy["sha256"],
    }
    if rec.get("git_diff_sha256"):
        out["clawpipe.git_diff_sha256"] = rec["git_diff_sha256"]
    if rec.get("harness_kit"):
        out["clawpipe.harness_kit.sha256"] = rec["harness_kit"]
    out.update({f"clawpipe.harness.{name}.sha256": h for name, h in rec["harnesses"].items()})
    out.update({f"clawpipe.task_set.{name}.sha256": h for name, h in rec["task_sets"].items()})
    out.update({f"clawpipe.version.{name}": v for name, v in rec["versions"].items()})
    return out


def location_tags(lake: str, run_dir: Path, flow_run_id: str | None) -> dict[str, str]:
    """Where the run's outputs are, as tags: the host and folder holding its state, logs and checkpoints,
    the lake holding its trajectories (without any credentials or query of its URL), its Prefect flow run."""
    import socket
    import urllib.parse

    parsed = urllib.parse.urlsplit(lake)
    if parsed.scheme and parsed.netloc:  # s3://key:secret@bucket/lake?endpoint=...: the bucket and path only
        lake = urllib.parse.urlunsplit((parsed.scheme, parsed.hostname or "", parsed.path, "", ""))
    out = {"clawpipe.host": socket.gethostname(), "clawpipe.run_dir": str(run_dir), "clawpipe.lake": lake}
    if flow_run_id:
        out["clawpipe.flow_run_id"] = flow_run_id
    return out


# --- the config as TOML -------------------------------------------------------------------------------


def config_toml(cfg: PipelineConfig, rec: Mapping[str, Any], run_id: str) -> str:
    """``cfg`` as TOML that ``clawpipe run --config`` reads back to the same config, followed by the
    run's provenance in the ``[recorded]`` table (read by :func:`changed_since`, left out of the config)."""
    head = [
        f"# The validated config of clawpipe run {run_id}; run it again (a knob changed, if you like) with",
        "#   clawpipe run --config config.toml",
        f"# [{RECORDED_TABLE}] holds what the run used; clawpipe run warns about what differs from it now.",
        "",
    ]
    body = _table(cfg.model_dump(mode="json"), [])
    recorded = _table({RECORDED_TABLE: {"run_id": run_id, **rec}}, [])
    return "\n".join([*head, *body, *recorded]).strip("\n") + "\n"


def _table(values: Mapping[str, Any], path: list[str]) -> list[str]:
    """TOML lines of a table: its plain keys first, then its sub-tables and arrays of tables (TOML puts
    every key of a table before the next header). None (no TOML value) is left out: such fields default
    to None."""
    lines: list[str] = []
    nested: list[list[str]] = []
    for key, value in values.items():
        if value is None:
            continue
        here = [*path, key]
        if isinstance(value, Mapping) and value:
            nested.append(["", f"[{_dotted(here)}]", *_table(value, here)])
        elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            for item in value:
                nested.append(["", f"[[{_dotted(here)}]]", *_table(item, here)])
        else:
            lines.append(f"{_key(key)} = {_value(value)}")
    return lines + [line for block in nested for line in block]


def _dotted(path: list[str]) -> str:
    return ".".join(_key(p) for p in path)


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _string(key)


def _string(text: str) -> str:
    # JSON's escapes are TOML's (\" \\ \n \t \uXXXX ...); TOML also wants DEL escaped, and ensure_ascii off
    # keeps characters outside the BMP whole (JSON would write them as surrogate pairs TOML refuses)
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):  # the config refuses these; a record never holds one
            raise ValueError(f"{value} has no TOML form here")
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items() if v is not None) + "}"
    raise ValueError(f"{value!r} ({type(value).__name__}) has no TOML form")


# --- a rerun ----------------------------------------------------------------------------------------------


def changed_since(cfg: PipelineConfig, recorded: Mapping[str, Any], *, policy: bool = True) -> dict[str, str]:
    """What ``cfg`` would run differently from the run that recorded ``recorded`` (a config.toml's
    ``[recorded]`` table, or a run state's provenance): each harness folder, the harness kit, task set source
    and (with ``policy``) initial policy folder whose content hash is not the recorded one, as what changed
    (``harness chat-loop``) -> how (``its folder ... hashes <now> now, <then> then``). Harnesses the config
    no longer uses are not compared."""
    changed: dict[str, str] = {}

    def compare(what: str, where: str, then: object, now: str) -> None:
        if isinstance(then, str) and then and then != "unknown" and then != now:
            changed[what] = f"{where} hashes {now} now, {then} then"

    then_harnesses = recorded.get("harnesses")
    then_harnesses = then_harnesses if isinstance(then_harnesses, Mapping) else {}
    harnesses, kit = harness_digests(cfg)
    from clawpipe.sandbox.manifest import find_harness

    for name, now in harnesses.items():
        compare(f"harness {name}", f"its folder {find_harness(name).dir}", then_harnesses.get(name), now)
    compare("the harness kit", "harnesses/_kit", recorded.get("harness_kit"), kit)
    then_tasks = recorded.get("task_sets")
    then_tasks = then_tasks if isinstance(then_tasks, Mapping) else {}
    for name, now in task_set_digests(cfg).items():
        compare(f"task set {name}", "its source", then_tasks.get(name), now)
    then_policy = recorded.get("policy")
    if policy and cfg.policy and isinstance(then_policy, Mapping):
        path = Path(cfg.policy).expanduser()
        if then_policy.get("dir") == str(path) and (path / "config.json").is_file():
            compare(f"policy {path}", "the folder", then_policy.get("sha256"), folder_digest(path))
    return changed


def rerun_warnings(cfg: PipelineConfig, recorded: Mapping[str, Any]) -> list[str]:
    """One message per thing :func:`changed_since` finds, for ``clawpipe run --config`` of a recorded config."""
    run = f"run {recorded['run_id']}" if recorded.get("run_id") else "the run that recorded this config"
    return [
        f"{what} is not what {run} used: {how}, so this run will not repeat that one exactly (check out git "
        f"revision {recorded.get('git', '?')} for the code it ran)"
        for what, how in changed_since(cfg, recorded).items()
    ]


def changed_on_resume(cfg: PipelineConfig, recorded: Mapping[str, Any], run_id: str, iteration: int) -> list[str]:
    """The harnesses, kit and task sets that changed since run ``run_id`` started, each said: its iterations
    from ``iteration`` on run the changed ones. The initial policy is not compared: a resumed run goes on
    from its checkpoint. Nothing for a run that recorded no provenance (started before runs did)."""
    if not recorded:
        return []
    changed = changed_since(cfg, recorded, policy=False)
    for what, how in changed.items():
        log.warning(
            "run %s resumes at iteration %d with %s changed since it started (%s): the iterations from here on "
            "run the changed one",
            run_id,
            iteration,
            what,
            how,
        )
    return list(changed)
