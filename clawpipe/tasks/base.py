"""Pieces every task set shares: split assignment, deterministic sampling, the task-instance check,
safe reading of what a harness left in its work dir, transcript reading.

Harnesses record what happened in ``<workdir>/out/transcript.json`` (:data:`TRANSCRIPT`); verifiers read it
with :func:`read_transcript`, which turns a missing, linked, oversized or garbage file into a reason, never
an exception. Every file a verifier takes from a work dir goes through :func:`read_workdir_file`: it never
follows a symbolic link (at any path component), never blocks on a FIFO and never reads past its limit.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import stat
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

from clawpipe.errors import ManifestError
from clawpipe.tasks.values import parse_plain_json

SPLITS = ("train", "eval")
TRANSCRIPT = Path("out") / "transcript.json"
MAX_TRANSCRIPT_BYTES = 4 * 1024 * 1024
MAX_TRANSCRIPT_DEPTH = 64
EVAL_SHARE = 5  # one instance key in EVAL_SHARE goes to the eval split
TASK_KEYS: dict[str, type] = {"task_set": str, "task_id": str, "prompt": str, "data": dict, "max_turns": int}
MAX_TASK_ID_CHARS = 200
HIDDEN = "hidden"  # task["data"]["hidden"]: for the verifier alone, never written where a harness can read it


def split_of(task_set: str, key: str) -> str:
    """The split an instance key belongs to: a stable hash, so train and eval never share an instance."""
    digest = hashlib.sha256(f"{task_set}:{key}".encode()).digest()
    return "eval" if int.from_bytes(digest[:4], "big") % EVAL_SHARE == 0 else "train"


def check_split(split: str) -> None:
    """Reject an unknown split name."""
    if split not in SPLITS:
        raise ManifestError(f"unknown split {split!r}: use one of {list(SPLITS)}")


def sample_keys(task_set: str, n: int, seed: int, split: str, draw: Callable[[random.Random], Hashable]) -> list[str]:
    """``n`` instance keys of ``split`` drawn with ``draw`` from a generator seeded by (task_set, split, seed).

    Keys are unique within the call while the split has unused keys; after that repeats get a ``~k`` suffix
    so that task ids stay unique.
    """
    check_split(split)
    if n < 0:
        raise ManifestError(f"n must be >= 0, got {n}")
    rng = random.Random(f"{task_set}:{split}:{seed}")
    seen: dict[str, int] = {}
    keys: list[str] = []
    misses = 0
    while len(keys) < n:
        key = str(draw(rng))
        if split_of(task_set, key) != split:
            continue
        if key in seen and misses < 500:
            misses += 1
            continue
        misses = 0
        count = seen.get(key, 0)
        seen[key] = count + 1
        keys.append(key if count == 0 else f"{key}~{count}")
    return keys


def validate_task(task: Any, where: str = "task") -> dict[str, Any]:
    """Check one task instance (docs/ARCHITECTURE.md, contract C) and return it; raise ManifestError naming ``where``
    and the field.

    The one check of a task's shape: task files, the runner's specs and generated tasks all go through it.
    """
    if not isinstance(task, dict):
        raise ManifestError(f"{where}: a task instance must be a JSON object, got {type(task).__name__}")
    for key, kind in TASK_KEYS.items():
        if key not in task:
            raise ManifestError(f"{where}: missing `{key}` (a task instance needs {sorted(TASK_KEYS)})")
        value = task[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ManifestError(f"{where}: `{key}` must be {kind.__name__}, got {type(value).__name__}")
    task_id = task["task_id"]
    # It names the rollout's folder and its log lines: no '/', no control character (NUL, newline), short.
    if not task_id or "/" in task_id or len(task_id) > MAX_TASK_ID_CHARS or not task_id.isprintable():
        raise ManifestError(
            f"{where}: `task_id` must be 1 to {MAX_TASK_ID_CHARS} printable characters without '/', "
            f"got {task_id[:MAX_TASK_ID_CHARS]!r}"
        )
    if task["max_turns"] < 1:
        raise ManifestError(f"{where}: `max_turns` must be >= 1, got {task['max_turns']}")
    if "sampling" in task and not isinstance(task["sampling"], dict):
        raise ManifestError(f'{where}: `sampling` must be an object such as {{"temperature": 0}}')
    try:
        json.dumps(task, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ManifestError(f"{where}: not plain JSON (no NaN, no objects, not nested too deep): {exc}") from exc
    return task


def without_hidden(task: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``task`` without ``data["hidden"]`` (the task itself when it has none)."""
    data = task.get("data")
    if not isinstance(data, dict) or HIDDEN not in data:
        return task
    return {**task, "data": {k: v for k, v in data.items() if k != HIDDEN}}


def harness_view(task: dict[str, Any], task_set: object = None) -> dict[str, Any]:
    """The task as a harness gets it (its task file): what the harness may see, never what only the
    verifier may know (an answer a policy with a shell could read and copy).

    ``task_set.harness_task(task)`` decides when the task set has one (every built-in set does: it lists
    the data keys its harnesses need); without one, the task goes as it is minus ``data["hidden"]``. Either
    way ``data["hidden"]`` never reaches a harness, and the view is checked like any task (ManifestError
    naming the task set when it is not one, or names another task). The caller's task is left whole: the
    verifier gets it on the host.
    """
    choose = getattr(task_set, "harness_task", None)
    if not callable(choose):
        return without_hidden(task)
    name = getattr(task_set, "name", "?")
    view = validate_task(choose(task), f"task set {name!r}'s harness view of {task.get('task_id')!r}")
    if view["task_id"] != task["task_id"] or view["task_set"] != task["task_set"]:
        raise ManifestError(
            f"task set {name!r}'s harness_task changed task_id/task_set of {task['task_id']!r}: a view keeps both"
        )
    return without_hidden(view)


def data_view(task: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """A copy of ``task`` whose ``data`` holds only ``keys`` (those present): a built-in set's harness view."""
    data = task.get("data")
    kept = {k: data[k] for k in keys if k in data} if isinstance(data, dict) else {}
    return {**task, "data": kept}


def load_task(path: str | Path) -> dict[str, Any]:
    """Read and validate a task JSON file."""
    p = Path(path)
    try:
        task = json.loads(p.read_text())
    except OSError as exc:
        raise ManifestError(f"cannot read task file {p}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ManifestError(f"task file {p} is not valid JSON: {exc}") from exc
    return validate_task(task, str(p))


class WorkdirFileError(Exception):
    """Why a file could not be taken from a work dir (the message names the relative path, never a host path)."""


def _open_below(root_fd: int, parts: list[str], rel: str) -> int:
    """A descriptor of ``parts`` below ``root_fd``, opened one component at a time without following links."""
    fd = root_fd
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_NONBLOCK if last else os.O_DIRECTORY)
            try:
                nxt = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise WorkdirFileError(f"{rel} goes through a symbolic link or a non-directory") from exc
                if exc.errno == errno.ENOENT:
                    raise WorkdirFileError(f"no {rel} in the work dir") from exc
                raise WorkdirFileError(f"cannot open {rel}: {exc.strerror}") from exc
            if fd != root_fd:
                os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        if fd != root_fd:
            os.close(fd)
        raise


def read_workdir_file(workdir: Path, rel: str | Path, max_bytes: int) -> bytes:
    """The bytes of the regular file ``rel`` inside ``workdir``; WorkdirFileError when it is missing, a link
    (anywhere on its path), not a regular file (FIFO, socket, device, directory) or larger than ``max_bytes``.
    """
    parts = Path(rel).parts
    if not parts or Path(rel).is_absolute() or any(p in ("..", ".") for p in parts):
        raise WorkdirFileError(f"{rel} is not a plain relative path")
    try:
        root_fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise WorkdirFileError(f"no {rel} in the work dir (the work dir is unreadable: {exc.strerror})") from exc
    try:
        fd = _open_below(root_fd, list(parts), str(rel))
    finally:
        os.close(root_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise WorkdirFileError(f"{rel} is not a regular file")
        if st.st_size > max_bytes:
            raise WorkdirFileError(f"{rel} is larger than {max_bytes} bytes")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:  # it grew after fstat
            raise WorkdirFileError(f"{rel} is larger than {max_bytes} bytes")
        return b"".join(chunks)
    except OSError as exc:
        raise WorkdirFileError(f"cannot read {rel}: {exc.strerror}") from exc
    finally:
        os.close(fd)


def write_workdir_file(workdir: Path, rel: str, text: str) -> None:
    """Create ``rel`` inside ``workdir`` holding ``text``: a task set's starting file, named by task data.

    The runner prepares work dirs as root, so a name from a task file never decides where on the host a
    file lands: ``rel`` must be a plain relative path (no absolute path, no ``.`` or ``..`` step, no NUL),
    each step is opened without following a symbolic link, and the file must not exist yet. Raises
    ManifestError naming the bad entry.
    """
    if not isinstance(rel, str) or not isinstance(text, str):
        raise ManifestError(f"a starting file needs a name and a text (strings), got {rel!r}: {type(text).__name__}")
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\0" in rel or any(p in ("", ".", "..") for p in parts):
        raise ManifestError(
            f"starting file {rel[:200]!r} is not a plain relative path inside the work dir (no leading '/', "
            "no '.' or '..' step, no empty step): fix the task's file names"
        )
    fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=fd)
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        out = os.open(parts[-1], flags, 0o644, dir_fd=fd)
    except OSError as exc:
        raise ManifestError(f"cannot create starting file {rel[:200]!r} in the work dir: {exc.strerror}") from exc
    finally:
        os.close(fd)
    with os.fdopen(out, "w", encoding="utf-8") as f:
        f.write(text)


def read_transcript(workdir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The harness's ``out/transcript.json`` as a dict, or (None, reason) when missing or unusable.

    Strict: plain JSON only (no NaN or Infinity, no duplicate keys, at most MAX_TRANSCRIPT_DEPTH levels),
    read without following links and only up to MAX_TRANSCRIPT_BYTES.
    """
    try:
        raw = read_workdir_file(Path(workdir), TRANSCRIPT, MAX_TRANSCRIPT_BYTES)
    except WorkdirFileError as exc:
        reason = str(exc)
        if reason.startswith("no "):
            reason = f"no {TRANSCRIPT} written by the harness"
        return None, reason
    try:
        data = parse_plain_json(raw, max_bytes=MAX_TRANSCRIPT_BYTES, max_depth=MAX_TRANSCRIPT_DEPTH, errors="replace")
    except ValueError as exc:
        return None, f"{TRANSCRIPT} is unusable: {exc}"[:300]
    if not isinstance(data, dict):
        return None, f"{TRANSCRIPT} is not a JSON object"
    return data, None


def transcript_turns(transcript: dict[str, Any]) -> list[dict[str, Any]]:
    """The transcript's ``turns`` list, keeping only well-formed entries (objects)."""
    turns = transcript.get("turns")
    if not isinstance(turns, list):
        return []
    return [t for t in turns if isinstance(t, dict)]


def as_text(value: Any, limit: int = 4000) -> str:
    """A transcript field as a bounded string ('' for anything that is not a string)."""
    return value[:limit] if isinstance(value, str) else ""
