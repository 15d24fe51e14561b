"""Checks that run work-dir code: what a task set asks a sandbox to run, and what the host gets back.

Some verifiers must execute what the harness left behind (``fixit`` calls the function in the model's
``solution.py``). The host never runs such code. A task set that needs it sets ``needs_sandbox = True``
and provides, instead of doing the work in ``verify``:

- ``check_program(task) -> CheckProgram``: the check's own files (written by the host, read-only in the
  sandbox), its argv, the work-dir files it needs (copied; never the live work dir) and its limits;
- ``score(task, run: CheckRun) -> (reward, info)``: the reward, decided by host code from
  ``run.output``, the JSON document the check wrote, already parsed by the host with
  :func:`~clawpipe.tasks.values.parse_plain_json` (plain values only). Compare it with expected values the
  host computed itself (:func:`~clawpipe.tasks.values.same_value`); nothing in the document is trusted,
  so no secret nonce is needed.

The rollout runner (``clawpipe.sandbox.verify``) runs the program in a fresh sandbox of the run's
backend: a host uid of its own (clawpipe.sandbox.uids), no network at all, time/memory/pids limits, a
copy of the declared inputs at ``$CLAWPIPE_WORKDIR`` (read-only apart from the two files below), no secrets
in its environment.

What the program sees and must do (the check protocol):

- its own files in one read-only folder (argv names them by absolute path);
- the copied inputs under ``$CLAWPIPE_WORKDIR`` (same relative paths as in the work dir);
- ``$CLAWPIPE_OUTPUT/result.json`` (:data:`RESULT_FILE`): an existing empty file it may write, where it
  writes ONE JSON document of plain values;
- ``$CLAWPIPE_OUTPUT/log.txt`` (:data:`LOG_FILE`): an existing empty file for its own output (a tail
  of it reaches the reward info); anything else it prints is discarded;
- a writable private /tmp; a hard file-size limit of max(max_result_bytes, 1 MiB) per file, no core dumps;
- the exit code is reported but decides nothing by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from clawpipe.errors import ConfigError

RESULT_FILE = "result.json"
LOG_FILE = "log.txt"


@dataclass(frozen=True, slots=True)
class CheckProgram:
    """A check to run in a sandbox against a copy of some work-dir files."""

    files: dict[str, str]  # file name -> text, written into the program folder (mounted read-only)
    command: tuple[str, ...]  # argv; a relative name of one of ``files`` resolves to the program folder
    inputs: tuple[str, ...] = ()  # work-dir relative paths of regular files to copy in (links are not followed)
    timeout_s: float = 10.0
    memory_mb: int = 512
    pids: int = 32
    max_input_bytes: int = 1 << 20  # all inputs together
    max_result_bytes: int = 1 << 20
    max_result_depth: int = 16

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError("a check program needs a command such as ('python3', '-I', 'check.py')")
        for name in self.files:
            if not name or "/" in name or name.startswith("."):
                raise ConfigError(f"check program file name {name!r} must be a plain name without '/'")
        if self.timeout_s <= 0 or self.memory_mb < 16 or self.pids < 1:
            raise ConfigError(
                f"check limits out of range: timeout_s={self.timeout_s} (> 0), memory_mb={self.memory_mb} "
                f"(>= 16), pids={self.pids} (>= 1)"
            )


@dataclass(slots=True)
class CheckRun:
    """What came back from one sandboxed check. ``output`` is None when no usable document was written."""

    output: Any = None
    reason: str | None = None  # why ``output`` is None
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    oom: bool = False
    skipped_inputs: list[str] = field(default_factory=list)  # inputs not copied, each with why
    log_tail: str = ""

    def summary(self) -> dict[str, Any]:
        """The fields worth keeping in a reward info (plain values, no host paths)."""
        out: dict[str, Any] = {"exit_code": self.exit_code, "timed_out": self.timed_out}
        if self.signal is not None:
            out["signal"] = self.signal
        if self.oom:
            out["oom"] = True
        if self.skipped_inputs:
            out["skipped_inputs"] = self.skipped_inputs
        if self.log_tail:
            out["output_tail"] = self.log_tail
        return out


@runtime_checkable
class SandboxedTaskSet(Protocol):
    """A task set whose verifier runs work-dir code: the check runs in a sandbox, the score on the host."""

    name: str
    needs_sandbox: bool

    def check_program(self, task: dict[str, Any]) -> CheckProgram: ...

    def score(self, task: dict[str, Any], run: CheckRun) -> tuple[float, dict[str, Any]]: ...

    def verify(self, task: dict[str, Any], workdir: Path) -> tuple[float, dict[str, Any]]: ...


def needs_sandbox(task_set: object) -> bool:
    """Whether ``task_set`` declares that its verifier runs work-dir code (``needs_sandbox = True``).

    Raises ConfigError when it declares so without ``check_program`` and ``score``.
    """
    if getattr(task_set, "needs_sandbox", False) is not True:
        return False
    if not isinstance(task_set, SandboxedTaskSet):
        name = getattr(task_set, "name", repr(task_set))
        raise ConfigError(
            f"task set {name!r} sets needs_sandbox = True but lacks check_program(task) and score(task, run); "
            "see clawpipe.tasks.check"
        )
    return True
