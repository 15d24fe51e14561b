"""The manifest of landed sources: which byte ranges of which segments and result files are in the lake.

It lives in ``<lake>/_manifest/`` as small JSON files, each written atomically:

- ``pending-<batch>.json`` lists the part files a landing batch is writing (rewritten before each new one);
- ``batch-<ns>-<batch>.json`` commits the batch: the source ranges it landed and its part files;
- ``checkpoint-<ns>.json`` folds many batch entries into one (idempotent: state merges by maximum).

A batch is committed by its ``batch-*`` file alone. On load, a pending batch without a commit is rolled
back (its part files deleted), so a landing killed at any point and run again lands every record once.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson

from clawpipe.tables import TMP_SUFFIX, LakeFS

log = logging.getLogger(__name__)

DIR = "_manifest"
CHECKPOINT_EVERY = 64  # batch entries before they are folded into a checkpoint


@dataclass
class SegmentState:
    end: int = 0  # bytes landed from the start of the segment
    done: bool = False  # sealed and landed to its end: never read again


@dataclass
class ManifestState:
    segments: dict[str, SegmentState] = field(default_factory=dict)
    results: dict[str, int] = field(default_factory=dict)
    n_entries: int = 0

    def merge(self, entry: dict[str, Any]) -> None:
        for key, (_start, end, done) in entry.get("segments", {}).items():
            st = self.segments.setdefault(key, SegmentState())
            st.end = max(st.end, end)
            st.done = st.done or bool(done)
        for key, (_start, end) in entry.get("results", {}).items():
            self.results[key] = max(self.results.get(key, 0), end)

    def to_json(self) -> dict[str, Any]:
        return {
            "segments": {k: [0, s.end, s.done] for k, s in sorted(self.segments.items())},
            "results": {k: [0, e] for k, e in sorted(self.results.items())},
        }


def load(lake: LakeFS) -> ManifestState:
    """Read the manifest, rolling back every uncommitted batch first."""
    files = lake.list_files(DIR, suffix=".json", recursive=False)
    names = [f.rsplit("/", 1)[-1] for f in files]
    committed = {n[:-5].rsplit("-", 1)[1] for n in names if n.startswith("batch-")}
    for name in names:
        if name.startswith("pending-"):
            batch = name[len("pending-") : -5]
            if batch not in committed:
                rollback(lake, batch)
            lake.delete(f"{DIR}/{name}")
    state = ManifestState()
    for name in names:
        if name.startswith(("batch-", "checkpoint-")):
            state.merge(orjson.loads(lake.read_bytes(f"{DIR}/{name}")))
            state.n_entries += name.startswith("batch-")
    return state


def rollback(lake: LakeFS, batch: str) -> None:
    pending = orjson.loads(lake.read_bytes(f"{DIR}/pending-{batch}.json"))
    for part in pending.get("parts", []):
        lake.delete(part)
        lake.delete(part + TMP_SUFFIX)
    log.warning("rolled back uncommitted landing batch=%s parts=%d", batch, len(pending.get("parts", [])))


def write_pending(lake: LakeFS, batch: str, parts: list[str]) -> None:
    lake.write_bytes(f"{DIR}/pending-{batch}.json", orjson.dumps({"batch": batch, "parts": parts}))


def commit(lake: LakeFS, batch: str, entry: dict[str, Any]) -> None:
    """Commit a batch (the one atomic step), then drop its pending marker."""
    lake.write_bytes(f"{DIR}/batch-{time.time_ns():020d}-{batch}.json", orjson.dumps({"batch": batch, **entry}))
    lake.delete(f"{DIR}/pending-{batch}.json")


def checkpoint(lake: LakeFS, state: ManifestState) -> None:
    """Fold batch entries and older checkpoints into one checkpoint file (safe to interrupt)."""
    files = lake.list_files(DIR, suffix=".json", recursive=False)
    old = [f for f in files if f.rsplit("/", 1)[-1].startswith(("batch-", "checkpoint-"))]
    lake.write_bytes(f"{DIR}/checkpoint-{time.time_ns():020d}.json", orjson.dumps(state.to_json()))
    for f in old:
        lake.delete(f)
    state.n_entries = 0


@contextmanager
def lake_lock(lake: LakeFS) -> Iterator[None]:
    """One writer (lander or compactor) per lake at a time; readers never wait."""
    if lake.is_local:
        os.makedirs(lake.full(DIR), exist_ok=True)
        path = lake.full(f"{DIR}/.lock")
    else:
        digest = hashlib.sha1(lake.url.encode()).hexdigest()[:16]
        path = os.path.join(tempfile.gettempdir(), f"clawpipe-lake-{digest}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
