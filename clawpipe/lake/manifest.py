"""The manifest of landed sources: which byte ranges of which segments and result files are in the lake.

It lives in ``<lake>/_manifest/`` as small JSON files, each written atomically:

- ``pending-<batch>.json`` lists the part files a landing batch is writing (rewritten before each new one);
- ``batch-<seq>.json`` commits the batch (its id inside): the source ranges it landed and its part files;
- ``checkpoint-<seq>.json`` folds the batch entries up to ``seq`` into one (idempotent: state merges by maximum);
- ``rolledback-<batch>.json`` (object stores) names the parts of a batch rolled back, which every load deletes
  again for a day: a writer that lost its lease while paused may still publish a part it had checked for.

A batch is committed by its ``batch-*`` file alone. On load, a pending batch without a commit is rolled
back (its part files deleted), so a landing killed at any point and run again lands every record once.

The commit needs no rename: ``batch-<seq>.json`` is created only if absent (:meth:`LakeFS.create_exclusive`:
a hard link locally, ``If-None-Match: *`` on S3), with ``seq`` one past the newest entry the writer has
loaded. Two writers can therefore never both commit on top of one state: the second one's name is taken,
its batch is rolled back and its landing fails (run it again; it lands what is still missing). Writers
are serialised by :func:`lake_lock` (``flock`` locally, the lease of :mod:`clawpipe.lake.lease` on
object stores); a writer that takes over an expired lease first commits a fence (an empty entry), so a
holder that was only paused finds its next name taken and stops before its batch counts.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import posixpath
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson

from clawpipe.errors import LakeError
from clawpipe.lake.lease import Lease
from clawpipe.tables import LOCKED_STAGING, TMP_SUFFIX, LakeFS, check_format

log = logging.getLogger(__name__)

DIR = "_manifest"
CHECKPOINT_EVERY = 64  # batch entries before they are folded into a checkpoint
ROLLED_BACK = "rolledback-"  # object stores: parts of a batch rolled back, deleted again by every load
# How long a rolled-back batch's parts are deleted again: far longer than any pause of a writer that then
# finishes publishing (a stopped process, a frozen VM); a writer that comes back later still fails its commit.
ROLLED_BACK_KEEP_S = 24 * 3600.0


@dataclass
class SegmentState:
    end: int = 0  # bytes landed from the start of the segment
    done: bool = False  # sealed and landed to its end: never read again


@dataclass
class ManifestState:
    segments: dict[str, SegmentState] = field(default_factory=dict)
    results: dict[str, int] = field(default_factory=dict)
    n_entries: int = 0
    seq: int = 0  # newest batch or checkpoint number loaded or committed: the next commit is seq + 1
    lease: Lease | None = None  # the object-store writer lease held while this state is written

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


def _seq(name: str) -> int:
    """The number in ``batch-<seq>.json`` / ``checkpoint-<seq>.json`` (older lakes: ``batch-<ns>-<id>.json``)."""
    try:
        return int(name[:-5].split("-")[1])
    except (IndexError, ValueError):
        return 0


def _entry_names(lake: LakeFS) -> list[str]:
    files = lake.list_files(DIR, suffix=".json", recursive=False)
    return [f.rsplit("/", 1)[-1] for f in files]


def fence(lake: LakeFS) -> int:
    """Commit an empty entry past every existing one; a writer holding an older state cannot commit after."""
    while True:
        seq = max((_seq(n) for n in _entry_names(lake) if n.startswith(("batch-", "checkpoint-"))), default=0) + 1
        if lake.create_exclusive(f"{DIR}/batch-{seq:020d}.json", orjson.dumps({"batch": "fence"})):
            return seq


def load(lake: LakeFS, lease: Lease | None = None) -> ManifestState:
    """Read the manifest, rolling back every uncommitted batch first.

    A lake in a later format (:func:`clawpipe.tables.check_format`) is refused before anything is touched."""
    check_format(lake)
    if lease is not None and lease.took_over:
        fence(lake)  # before rolling back: the previous holder's batch must not commit after that
    if lake.is_local:  # what a writer that failed or was killed mid-write left (the caller holds the lock)
        sweep_temporary(lake, DIR)
    sweep_locked_staging(lake)
    names = _entry_names(lake)
    state = ManifestState(lease=lease)
    committed: set[str] = set()
    for name in names:
        if name.startswith(("batch-", "checkpoint-")):
            entry = orjson.loads(lake.read_bytes(f"{DIR}/{name}"))
            committed.add(str(entry.get("batch", "")))
            state.merge(entry)
            state.n_entries += name.startswith("batch-")
            state.seq = max(state.seq, _seq(name))
    for name in names:
        if name.startswith("pending-"):
            batch = name[len("pending-") : -5]
            if batch not in committed:
                parts = rollback(lake, batch)
                if not lake.is_local and parts:
                    _keep_rolled_back(lake, batch, parts)
            lake.delete(f"{DIR}/{name}")
        elif name.startswith(ROLLED_BACK):
            _roll_back_again(lake, name)
    return state


def _keep_rolled_back(lake: LakeFS, batch: str, parts: list[str]) -> None:
    """Remember the parts of a batch rolled back on an object store. Its writer may only be paused (a lease
    expired under it): resumed, it can publish a part it had checked its lease for before the pause, and die
    before its commit fails and it removes the part. Every later load deletes the parts again."""
    body = orjson.dumps({"batch": batch, "parts": parts, "at": time.time()})
    lake.write_bytes(f"{DIR}/{ROLLED_BACK}{batch}.json", body)


def _roll_back_again(lake: LakeFS, name: str) -> None:
    """Delete a rolled-back batch's parts again (nothing to do unless its writer came back), and forget the
    batch once no writer can still be running it."""
    try:
        entry = orjson.loads(lake.read_bytes(f"{DIR}/{name}"))
    except FileNotFoundError:
        return
    except orjson.JSONDecodeError:
        entry = {}
    for part in entry.get("parts", []):
        lake.delete(part)
        lake.delete(part + TMP_SUFFIX)
    if time.time() - float(entry.get("at", 0)) > ROLLED_BACK_KEEP_S:
        lake.delete(f"{DIR}/{name}")


def check_writer(state: ManifestState) -> None:
    """Raise unless this writer still holds the lake (before publishing parts or committing)."""
    if state.lease is not None and not state.lease.valid():
        raise LakeError(
            f"lost the writer lease of {state.lease.lake.url} (expired or taken by another writer); "
            "this landing stops uncommitted; run it again"
        )


def rollback(lake: LakeFS, batch: str) -> list[str]:
    """Delete the parts an uncommitted batch's pending record names; returns them."""
    try:
        pending = orjson.loads(lake.read_bytes(f"{DIR}/pending-{batch}.json"))
    except FileNotFoundError:
        return []  # a batch that wrote no part (or was rolled back already)
    parts = [str(p) for p in pending.get("parts", [])]
    for part in parts:
        lake.delete(part)
        lake.delete(part + TMP_SUFFIX)
    if lake.is_local:
        # a kill inside a small file's write (a sidecar: temp name, then rename) leaves its temporary file
        # beside the part; only lock holders write these folders, and the caller holds the lock
        for folder in sorted({posixpath.dirname(p) for p in parts}):
            sweep_temporary(lake, folder)
    log.warning("rolled back uncommitted landing batch=%s parts=%d", batch, len(parts))
    return parts


def write_pending(lake: LakeFS, batch: str, parts: list[str]) -> None:
    lake.write_bytes(f"{DIR}/pending-{batch}.json", orjson.dumps({"batch": batch, "parts": parts}))


def commit(lake: LakeFS, batch: str, entry: dict[str, Any], state: ManifestState | None = None) -> None:
    """Commit a batch (the one atomic step: create ``batch-<seq>`` if absent), then drop its pending marker.

    Raises :class:`LakeError` (the batch rolled back) when another writer committed since ``state`` was loaded.
    """
    if state is None:
        state = load_seq(lake)
    check_writer(state)
    seq = state.seq + 1
    name = f"{DIR}/batch-{seq:020d}.json"  # the number alone: one commit per number, whoever makes it
    if not lake.create_exclusive(name, orjson.dumps({"batch": batch, **entry})):
        rollback(lake, batch)
        raise LakeError(
            f"another writer committed entry {seq} of {lake.url} first; this batch was rolled back, "
            "run the landing again"
        )
    state.seq = seq  # made: from here on the batch counts, whatever fails next (callers must not roll it back)
    if any(n.startswith("checkpoint-") and _seq(n) >= seq for n in _entry_names(lake)):
        # a writer that fenced us out has already folded and deleted entry `seq`: ours came too late
        lake.delete(name)
        rollback(lake, batch)
        state.seq = seq - 1
        raise LakeError(f"entry {seq} of {lake.url} was already checkpointed by another writer; run again")
    lake.delete(f"{DIR}/pending-{batch}.json")


def sweep_temporary(lake: LakeFS, folder: str, prefix: str = "") -> None:
    """Delete the temporary files (``*.inprogress``) a failed write left in ``folder`` (those whose names start
    with ``prefix``). Only for folders that nobody but the lake's lock holder writes (this one, partitions of
    ``model_calls``, ``rejects``): the caller holds the lock."""
    for rel in lake.list_files(folder, suffix=TMP_SUFFIX, recursive=False):
        if posixpath.basename(rel).startswith(prefix):
            lake.delete(rel)


def sweep_locked_staging(lake: LakeFS) -> None:
    """Delete the staging folders of lock holders (``_staging/locked-*``: a compaction's merged files, or a
    partition swapped out and not yet deleted) that a killed holder left. The caller holds the lock, so none
    is in use; the folders of tree builds, which stage without the lock, are left alone."""
    head, prefix = posixpath.split(LOCKED_STAGING)
    for name in lake.list_dirs(head):
        if name.startswith(prefix):
            lake.delete_dir(f"{head}/{name}")


def load_seq(lake: LakeFS) -> ManifestState:
    """A state carrying only the newest entry number (for committing without a loaded state)."""
    names = [n for n in _entry_names(lake) if n.startswith(("batch-", "checkpoint-"))]
    return ManifestState(seq=max((_seq(n) for n in names), default=0))


def checkpoint(lake: LakeFS, state: ManifestState) -> None:
    """Fold batch entries and older checkpoints into one checkpoint file (safe to interrupt)."""
    files = lake.list_files(DIR, suffix=".json", recursive=False)
    # only entries this state has merged (a newer one would be another writer's, kept for the next load)
    old = [
        f
        for f in files
        if f.rsplit("/", 1)[-1].startswith(("batch-", "checkpoint-")) and _seq(f.rsplit("/", 1)[-1]) <= state.seq
    ]
    check_writer(state)
    lake.write_bytes(f"{DIR}/checkpoint-{state.seq:020d}.json", orjson.dumps(state.to_json()))
    for f in old:
        lake.delete(f)
    state.n_entries = 0


@contextmanager
def lake_lock(lake: LakeFS) -> Iterator[Lease | None]:
    """One writer (lander or compactor) per lake at a time; readers never wait.

    Local lakes: ``flock`` (yields None). Object stores: the lake's writer lease, held across hosts
    (yields it; pass it to :func:`load` so commits check it).
    """
    if not lake.is_local and lake.scheme != "memory":
        lease = Lease(lake)
        lease.acquire()
        try:
            yield lease
        finally:
            lease.release()
        return
    if lake.is_local:
        os.makedirs(lake.full(DIR), exist_ok=True)
        path = lake.full(f"{DIR}/.lock")
    else:
        digest = hashlib.sha1(lake.url.encode()).hexdigest()[:16]
        path = os.path.join(tempfile.gettempdir(), f"clawpipe-lake-{digest}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield None
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
