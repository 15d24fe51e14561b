"""Pieces every task set shares: split assignment, deterministic sampling, task-file checks, transcript reading.

Harnesses record what happened in ``<workdir>/out/transcript.json`` (:data:`TRANSCRIPT`); verifiers read it
with :func:`read_transcript`, which turns a missing, oversized or garbage file into a reason, never an
exception.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

from clawpipe.errors import ManifestError

SPLITS = ("train", "eval")
TRANSCRIPT = Path("out") / "transcript.json"
MAX_TRANSCRIPT_BYTES = 4 * 1024 * 1024
EVAL_SHARE = 5  # one instance key in EVAL_SHARE goes to the eval split
_REQUIRED = {"task_set": str, "task_id": str, "prompt": str, "data": dict, "max_turns": int}


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


def validate_task(task: Any) -> dict[str, Any]:
    """Check a task instance's shape (CONTRACTS C); raise ManifestError naming the bad field."""
    if not isinstance(task, dict):
        raise ManifestError(f"a task instance must be a JSON object, got {type(task).__name__}")
    for field, kind in _REQUIRED.items():
        if field not in task:
            raise ManifestError(f"task instance lacks {field!r}; required: {sorted(_REQUIRED)}")
        value = task[field]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ManifestError(f"task field {field!r} must be {kind.__name__}, got {type(value).__name__}")
    if task["max_turns"] < 1:
        raise ManifestError(f"task field 'max_turns' must be >= 1, got {task['max_turns']}")
    if "sampling" in task and not isinstance(task["sampling"], dict):
        raise ManifestError("task field 'sampling' must be an object such as {\"temperature\": 0}")
    return task


def load_task(path: str | Path) -> dict[str, Any]:
    """Read and validate a task JSON file."""
    p = Path(path)
    try:
        task = json.loads(p.read_text())
    except OSError as exc:
        raise ManifestError(f"cannot read task file {p}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ManifestError(f"task file {p} is not valid JSON: {exc}") from exc
    return validate_task(task)


def read_transcript(workdir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The harness's ``out/transcript.json`` as a dict, or (None, reason) when missing or unusable."""
    path = Path(workdir) / TRANSCRIPT
    try:
        if path.is_symlink() or not path.is_file():
            return None, f"no {TRANSCRIPT} written by the harness"
        if path.stat().st_size > MAX_TRANSCRIPT_BYTES:
            return None, f"{TRANSCRIPT} is larger than {MAX_TRANSCRIPT_BYTES} bytes"
        data = json.loads(path.read_bytes().decode("utf-8", errors="replace"))
    except (OSError, ValueError, RecursionError) as exc:
        return None, f"{TRANSCRIPT} is unreadable: {type(exc).__name__}: {exc}"[:300]
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
