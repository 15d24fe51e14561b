"""Task sets: generators of task instances and the verifiers that reward what a harness left behind.

A task set (docs/ARCHITECTURE.md, contract C) has a ``name`` and three methods:

- ``generate(n, seed, split="train") -> list[dict]``: ``n`` task instances, deterministic per seed, with
  keys ``task_set``, ``task_id`` (unique within one call), ``prompt``, ``data`` (task-specific, may hold the
  secret the harness needs to play the environment), ``max_turns`` and ``sampling`` (defaults the harness
  passes to the model, e.g. ``{"temperature": 1.0, "max_tokens": 16}``). Splits "train" and "eval" never
  share an instance. The verifier gets the whole task, on the host; a harness gets its view only.
- ``harness_task(task) -> dict`` (optional): that view, written as the sandbox's task file: the task with
  only the data its harness needs, never an answer (a policy with a shell reads every file and variable
  it can see). The built-in sets keep only the ``data`` keys their harnesses use. Without the method the
  harness gets the whole task except ``data["hidden"]``, so a custom set puts what only its verifier may
  know under ``data["hidden"]`` or defines ``harness_task`` (:func:`harness_view`). The task id reaches
  the sandbox too (task file, proxy key): it must not name an answer either.
- ``prepare(task, workdir)``: writes starting files into a fresh work dir (file-based tasks; no-op otherwise).
- ``verify(task, workdir) -> (reward, reward_info)``: runs on the host after the harness exits; reward in
  [0, 1]; never raises on missing or garbage output (reward 0 and ``reward_info["reason"]``). It only reads
  data (e.g. with :func:`read_transcript` / :func:`read_workdir_file`), never runs anything from the work dir.

A verifier that must run work-dir code declares ``needs_sandbox = True`` and provides ``check_program`` and
``score`` (:mod:`clawpipe.tasks.check`): the runner runs the check in a fresh sandbox and the host scores
the plain JSON it wrote. Whatever a harness writes must never earn more than an honest attempt: the suite in
tests/tasks/forgery.py runs crafted outputs against every registered task set.

Built-in sets: ``guess`` (multi-turn guess-a-number), ``calc`` (arithmetic with a calculator tool),
``fixit`` (make a small program's check pass) and ``say`` (reply with a phrase; graded, for harnesses whose
only trace is their final reply, such as the agent CLIs). Each module's docstring states its transcript
contract: what one turn is (one model call), which fields the verifier reads (``answer`` vs ``reply`` in
guess, ``final`` and the calculator calls in calc, ``final`` alone in say, no transcript at all in fixit)
and what it ignores.

Register your own with :func:`register_task_set`, or name one as ``"package.module:attribute"`` and
:func:`get_task_set` imports it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from clawpipe.errors import ConfigError
from clawpipe.tasks.base import (
    SPLITS,
    TRANSCRIPT,
    WorkdirFileError,
    harness_view,
    load_task,
    read_transcript,
    read_workdir_file,
    validate_task,
    write_workdir_file,
)
from clawpipe.tasks.check import CheckProgram, CheckRun, SandboxedTaskSet, needs_sandbox

__all__ = [
    "SPLITS",
    "TRANSCRIPT",
    "CheckProgram",
    "CheckRun",
    "SandboxedTaskSet",
    "TaskSet",
    "WorkdirFileError",
    "get_task_set",
    "harness_view",
    "list_task_sets",
    "load_task",
    "needs_sandbox",
    "read_transcript",
    "read_workdir_file",
    "register_task_set",
    "validate_task",
    "write_workdir_file",
]


@runtime_checkable
class TaskSet(Protocol):
    """What the runner and the pipeline need from a task set (see the module docstring)."""

    name: str

    def generate(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]: ...

    def prepare(self, task: dict[str, Any], workdir: Path) -> None: ...

    def verify(self, task: dict[str, Any], workdir: Path) -> tuple[float, dict[str, Any]]: ...


_REGISTRY: dict[str, TaskSet] = {}


def _builtins() -> dict[str, TaskSet]:
    from clawpipe.tasks.calc import CalcTaskSet
    from clawpipe.tasks.fixit import FixitTaskSet
    from clawpipe.tasks.guess import GuessTaskSet
    from clawpipe.tasks.say import SayTaskSet

    return {ts.name: ts for ts in (GuessTaskSet(), CalcTaskSet(), FixitTaskSet(), SayTaskSet())}


def register_task_set(task_set: TaskSet) -> None:
    """Make ``task_set`` available to :func:`get_task_set` under its ``name`` (replacing any previous one)."""
    if not isinstance(task_set, TaskSet):
        raise ConfigError(f"{task_set!r} is not a task set: it needs name, generate, prepare and verify")
    needs_sandbox(task_set)  # a set that declares a sandboxed check must provide it
    _REGISTRY[task_set.name] = task_set


def list_task_sets() -> list[str]:
    """Names of the registered task sets, sorted."""
    return sorted({**_builtins(), **_REGISTRY})


def _import_spec(spec: str) -> TaskSet:
    module_name, _, attr = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot import task set {spec!r}: {exc}; use 'package.module:attribute'") from exc
    task_set = obj() if isinstance(obj, type) else obj
    if not isinstance(task_set, TaskSet):
        raise ConfigError(f"{spec!r} is not a task set: it needs name, generate, prepare and verify")
    return task_set


def get_task_set(name: str) -> TaskSet:
    """The task set called ``name`` (built-in, registered, or ``"package.module:attribute"``)."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    builtins = _builtins()
    if name in builtins:
        return builtins[name]
    if ":" in name:
        return _import_spec(name)
    raise ConfigError(f"unknown task set {name!r}; choose one of {list_task_sets()} or pass 'package.module:attr'")
