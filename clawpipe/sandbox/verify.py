"""Verifying a finished rollout: host verifiers read data; work-dir code only ever runs in a fresh sandbox.

:func:`verify_rollout` is what the runner calls after a harness exits. A task set whose verifier only
reads (``guess``, ``calc``) is called directly. One that declares ``needs_sandbox = True`` (``fixit``;
see clawpipe.tasks.check) gets its check run by :func:`run_check` in a new sandbox of the run's backend:

- a fresh folder holding a COPY of the declared inputs only (regular files taken without following links,
  size-capped; the live work dir is never mounted), owned by root and read-only to the sandbox except the
  two files the check writes (result.json, log.txt);
- a host uid of its own (clawpipe.sandbox.uids) without capabilities, the backend's time/memory/pids
  limits plus a file-size limit that the check cannot raise (``prlimit --fsize``, so no file it writes
  outgrows what the host reads), and NO network: the listener the backend opens in the sandbox's network
  namespace is closed at once (:class:`ClosedBridge`), so nothing answers at any address;
- an environment without secrets: the rollout's proxy key is never passed (a placeholder stands in),
  the task file is an empty object, so the expected values stay on the host.

The host then reads result.json (no links, bounded size) and parses it as plain JSON with depth limits;
the task set's ``score`` compares values it holds itself. The process backend isolates nothing: it runs
such checks only when the operator opts in (CLAWPIPE_UNSAFE_PROCESS_CHECKS=1), see :func:`check_backend`.

A task set's own code that runs on the host (``verify``, ``check_program``, ``score``) runs under a time
limit (:func:`within`, ``CLAWPIPE_VERIFY_TIMEOUT_S``): Python cannot stop a thread, so a verifier that hangs
is left running in a daemon thread of its own and the rollout ends with :class:`VerifierTimeoutError`.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from clawpipe.errors import ConfigError, ManifestError, SandboxError, VerifierTimeoutError
from clawpipe.sandbox.backends.base import Backend, SandboxJob, takes_own_uids
from clawpipe.sandbox.bridge import Bridge, Route
from clawpipe.sandbox.limits import Limits
from clawpipe.sandbox.manifest import HarnessManifest
from clawpipe.sandbox.uids import SHARED_USER, SandboxUser, UidLease, UidPool, default_pool
from clawpipe.tasks.base import WorkdirFileError, read_workdir_file
from clawpipe.tasks.check import LOG_FILE, RESULT_FILE, CheckProgram, CheckRun, SandboxedTaskSet, needs_sandbox
from clawpipe.tasks.values import parse_plain_json

logger = logging.getLogger(__name__)

ISOLATING_BACKENDS = ("bwrap", "docker")
PLACEHOLDER_KEY = "no-key-in-checks"  # what the check sees where a harness sees its proxy key
LOG_TAIL_CHARS = 1000
MAX_LOG_READ = 1 << 20
PRLIMIT = "/usr/bin/prlimit"  # util-linux, like the setpriv the bwrap backend needs
LIMIT_SETTING = "CLAWPIPE_VERIFY_TIMEOUT_S"  # the setting (or run_rollouts' verify_timeout_s) a timeout names
T = TypeVar("T")


class Verifiable(Protocol):
    """What :func:`verify_rollout` needs of a task set (clawpipe.tasks.TaskSet satisfies it)."""

    name: str

    def verify(self, task: dict[str, Any], workdir: Path) -> tuple[float, dict[str, Any]]: ...


class ClosedBridge(Bridge):
    """A bridge that forwards nothing: the listener a backend hands it is closed at once.

    The sandbox's network namespace then holds no listener at all, so every connection is refused; the
    backends need no special case for a sandbox without network.
    """

    def __init__(self) -> None:  # no event loop: there is nothing to forward
        pass

    def attach(self, sock: socket.socket) -> Route:
        port = sock.getsockname()[1] if sock.family in (socket.AF_INET, socket.AF_INET6) else 0
        sock.close()
        return Route(port=port)

    def detach(self, route: Route) -> None:
        pass

    def close(self) -> None:
        pass


def check_backend(backend_name: str, task_set_name: str, allow_unsafe: bool | None = None) -> None:
    """Raise ConfigError when ``backend_name`` cannot isolate the check of task set ``task_set_name``.

    bwrap and docker isolate; any other backend (process) needs the operator's explicit opt-in:
    ``allow_unsafe=True`` or CLAWPIPE_UNSAFE_PROCESS_CHECKS=1 when ``allow_unsafe`` is None.
    """
    if backend_name in ISOLATING_BACKENDS:
        return
    if allow_unsafe is None:
        from clawpipe.config import get_settings

        allow_unsafe = get_settings().unsafe_process_checks
    if not allow_unsafe:
        raise ConfigError(
            f"task set {task_set_name!r} runs work-dir code in its verifier, and the {backend_name!r} backend "
            f"does not isolate it: it would run on this host as uid {os.geteuid()}. Use --backend bwrap or "
            "docker, or set CLAWPIPE_UNSAFE_PROCESS_CHECKS=1 if every model and harness is trusted"
        )
    logger.warning("running %s checks without isolation on the %s backend (opted in)", task_set_name, backend_name)


def preflight(backend_name: str, names: Iterable[str], resolve: Callable[[str], object]) -> None:
    """Before any rollout runs: refuse task sets whose checks ``backend_name`` cannot isolate.

    Names that do not resolve are left for the rollouts themselves to report.
    """
    for name in sorted(set(names)):
        try:
            task_set = resolve(name)
        except ConfigError:
            continue
        if needs_sandbox(task_set):
            check_backend(backend_name, name)


def _owner(backend: Backend, user: SandboxUser) -> tuple[int, int] | None:
    """Who the writable check files must belong to: the sandbox user, or None (mode 0666 instead)."""
    if backend.name == "process" or os.geteuid() != 0:
        return None
    return user.uid, user.gid


def _lease(backend: Backend, uids: UidPool | None) -> UidLease:
    """The check sandbox's own uid (none for a backend that takes none, see takes_own_uids)."""
    if not takes_own_uids(backend):
        return UidLease(SHARED_USER, None)
    return (uids or default_pool()).lease()


def copy_inputs(workdir: Path, dest: Path, inputs: Iterable[str], max_bytes: int) -> list[str]:
    """Copy the regular files ``inputs`` (relative paths) from ``workdir`` into ``dest``; return the ones
    skipped, each with why (missing, a link anywhere on its path, not a regular file, over the byte budget).

    Copies are root's (the runner's), mode 0644 in 0755 folders: readable, not writable, in the sandbox.
    """
    skipped: list[str] = []
    budget = max_bytes
    for rel in inputs:
        try:
            data = read_workdir_file(workdir, rel, budget)
        except WorkdirFileError as exc:
            skipped.append(str(exc))
            continue
        budget -= len(data)
        target = dest / rel
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return skipped


def _writable_file(path: Path, owner: tuple[int, int] | None) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        if owner is None:
            os.fchmod(fd, 0o666)
        else:
            os.fchown(fd, *owner)
    finally:
        os.close(fd)


def _lay_out(vdir: Path, program: CheckProgram, workdir: Path, owner: tuple[int, int] | None) -> list[str]:
    """The check's folder: program/ (its files), work/ (the input copies and out/), task.json; returns the
    skipped inputs."""
    prog = vdir / "program"
    prog.mkdir(mode=0o755)
    for name, text in program.files.items():
        (prog / name).write_text(text)
        (prog / name).chmod(0o644)
    work = vdir / "work"
    work.mkdir(mode=0o755)
    skipped = copy_inputs(workdir, work, program.inputs, program.max_input_bytes)
    (work / "out").mkdir(mode=0o755)
    for name in (RESULT_FILE, LOG_FILE):
        _writable_file(work / "out" / name, owner)
    (vdir / "task.json").write_text("{}")  # the check learns its task from its own files, not from the task
    (vdir / "task.json").chmod(0o644)
    for d in (vdir, prog, work):
        d.chmod(0o755)
    return skipped


def _read_result(work: Path, program: CheckProgram) -> tuple[Any, str | None]:
    try:
        raw = read_workdir_file(work, f"out/{RESULT_FILE}", program.max_result_bytes)
    except WorkdirFileError as exc:
        return None, str(exc)
    if not raw.strip():
        return None, f"the check wrote nothing to {RESULT_FILE}"
    try:
        return parse_plain_json(raw, max_bytes=program.max_result_bytes, max_depth=program.max_result_depth), None
    except ValueError as exc:
        return None, f"{RESULT_FILE} is unusable: {exc}"


def _log_tail(work: Path, vdir: Path) -> str:
    try:
        raw = read_workdir_file(work, f"out/{LOG_FILE}", MAX_LOG_READ)
    except WorkdirFileError:
        return ""
    text = raw[-4 * LOG_TAIL_CHARS :].decode("utf-8", errors="replace")
    return text.replace(str(vdir), "<check>")[-LOG_TAIL_CHARS:]  # no host path in the reward info


def _limited(command: tuple[str, ...], program: CheckProgram) -> tuple[str, ...]:
    """``command`` under hard rlimits set before it starts: file size (what the host reads, never more) and
    no core dumps."""
    if not Path(PRLIMIT).is_file():
        raise SandboxError(f"{PRLIMIT} (util-linux) not found: apt-get install -y util-linux")
    fsize = max(program.max_result_bytes, MAX_LOG_READ)
    return (PRLIMIT, f"--fsize={fsize}", "--core=0", "--", *command)


def run_check(
    backend: Backend,
    program: CheckProgram,
    workdir: Path,
    *,
    scratch: Path | None = None,
    label: str = "check",
    uids: UidPool | None = None,
) -> CheckRun:
    """Run ``program`` against copies of its inputs from ``workdir`` in a fresh sandbox of ``backend``.

    ``scratch`` is the host folder for the check's own folder (default: the system's temporary folder,
    outside the rollout's disk quota, which the harness may have filled); the folder is removed
    afterwards. ``label`` names the sandbox in logs. The sandbox runs as a uid of its own from ``uids``
    (default: the settings' range). Raises SandboxError when the sandbox cannot start.
    """
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
    vdir = Path(tempfile.mkdtemp(prefix="clawpipe-check-", dir=scratch))
    lease = UidLease(SHARED_USER, None)
    try:
        lease = _lease(backend, uids)  # inside: whatever fails from here on, the uid is given back
        skipped = _lay_out(vdir, program, workdir, _owner(backend, lease.user))
        tag = re.sub(r"[^a-z0-9_.-]", "-", label.lower())[:40] or "check"
        manifest = HarnessManifest(
            name=f"check-{tag}",
            dir=vdir / "program",
            command=_limited(program.command, program),
            timeout_s=program.timeout_s,
            limits=Limits(memory_mb=program.memory_mb, cpus=1.0, pids=program.pids),
        )
        job = SandboxJob(
            rollout_id=f"check-{tag}",
            manifest=manifest,
            rollout_dir=vdir,
            key=PLACEHOLDER_KEY,
            model="none",
            timeout_s=program.timeout_s,
            limits=manifest.limits,
            user=lease.user,
        )
        try:
            outcome = backend.run(job, ClosedBridge())
        finally:
            lease.release()  # its processes are gone: what it wrote is read below as root
        work = vdir / "work"
        output, reason = _read_result(work, program)
        return CheckRun(
            output=output,
            reason=reason,
            exit_code=outcome.exit_code,
            signal=outcome.signal,
            timed_out=outcome.timed_out,
            oom=outcome.oom,
            skipped_inputs=skipped,
            log_tail=_log_tail(work, vdir),
        )
    finally:
        lease.release()
        shutil.rmtree(vdir, ignore_errors=True)


def within(limit_s: float | None, what: str, fn: Callable[[], T]) -> T:
    """``fn()``'s result (or what it raised) when it returns within ``limit_s`` seconds (None: no limit);
    VerifierTimeoutError naming ``what``, the limit and its setting otherwise.

    ``fn`` runs in a daemon thread of its own, never one of the runner's pools: a hung one is abandoned
    there (Python cannot stop a thread), so it holds neither a rollout slot nor the batch's end.
    """
    if limit_s is None:
        return fn()
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def call() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread, which decides
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=call, name=f"verify-{what}"[:60], daemon=True).start()
    if not done.wait(limit_s):
        logger.warning("%s still running after %.4g s: left behind in its thread", what, limit_s)
        raise VerifierTimeoutError(
            f"{what} did not return within {limit_s:g} s ({LIMIT_SETTING}, or run_rollouts' verify_timeout_s): "
            "no reward; make it return sooner or raise the limit"
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]  # type: ignore[no-any-return]


def verify_rollout(
    task_set: Verifiable,
    task: dict[str, Any],
    workdir: Path,
    backend: Backend,
    *,
    scratch: Path | None = None,
    allow_unsafe: bool | None = None,
    uids: UidPool | None = None,
    timeout_s: float | None = None,
) -> tuple[float, dict[str, Any]]:
    """(reward, reward_info) of the finished rollout whose work dir is ``workdir``.

    Read-only verifiers are called as they are; a ``needs_sandbox`` task set has its check run in a
    fresh sandbox of ``backend`` (refused on a non-isolating backend unless the operator opted in, see
    :func:`check_backend`) and is scored on the host. ``scratch`` holds the check's folder while it runs
    (default: the system's temporary folder). A task whose data cannot make a check gets reward 0 with
    the reason. ``uids`` is where the check's sandbox takes its own uid (default: the settings' range).
    ``timeout_s`` bounds each piece of the task set's own code run here (``verify``; ``check_program`` and
    ``score``), not the sandboxed check, which its CheckProgram's limits bound (:func:`within`).
    """
    what = f"the verifier of task set {task_set.name!r}"
    if not needs_sandbox(task_set):
        return within(timeout_s, what, lambda: task_set.verify(task, workdir))
    assert isinstance(task_set, SandboxedTaskSet)  # needs_sandbox checked it
    sandboxed = task_set
    check_backend(backend.name, task_set.name, allow_unsafe)
    try:
        program = within(timeout_s, f"{what} (check_program)", lambda: sandboxed.check_program(task))
    except ManifestError as exc:
        return 0.0, {"reason": str(exc)}
    label = f"{task_set.name}-{task.get('task_id', '')}"
    run = run_check(backend, program, Path(workdir), scratch=scratch, label=label, uids=uids)
    return within(timeout_s, f"{what} (score)", lambda: sandboxed.score(task, run))
