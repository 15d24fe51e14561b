"""The persisted call-id index of a ``model_calls`` partition: which call ids its committed parts hold.

Each part ``part-<x>.parquet`` has a sidecar ``part-<x>.ids``: the sorted, distinct 64-bit hashes
(blake2b) of its call ids, little-endian. The sidecar is written with its part and committed by the
same manifest entry (it is listed among the batch's parts, so a rolled-back batch loses both), and
views never read it (their globs match ``*.parquet`` only).

A landing run checks the calls it is about to write against the sidecars, a batch of hashes at a time
(``searchsorted`` over each sidecar; a large one memory-mapped on a local lake, a small one read): the cost
per call depends on the number of parts, not on how many calls were landed before, and nothing
proportional to a large part is loaded. A hash hit is confirmed against the call ids of that part alone
(a 64-bit collision must not drop a call), so only true duplicates cost a read of their part. A part
without a sidecar (landed before sidecars existed, or written by compaction) gets one built from its
``call_id`` column the first time its partition is landed into.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
from collections.abc import Iterable

import numpy as np

from clawpipe.lake import manifest
from clawpipe.tables import LakeFS

log = logging.getLogger(__name__)

SUFFIX = ".ids"
IN_MEMORY = 1 << 16  # sidecars up to this size (8,192 calls) are read whole; larger ones mapped while searched
_PARQUET = ".parquet"
_DTYPE = np.dtype("<u8")


def sidecar(part: str) -> str:
    """The sidecar path of a part file."""
    return part[: -len(_PARQUET)] + SUFFIX if part.endswith(_PARQUET) else part + SUFFIX


def hash_ids(call_ids: Iterable[str]) -> np.ndarray:
    """64-bit hashes of call ids, in order (stable across processes and versions)."""
    digest = b"".join([hashlib.blake2b(c.encode(), digest_size=8).digest() for c in call_ids])
    return np.frombuffer(digest, dtype=_DTYPE)


def encode(hashes: np.ndarray) -> bytes:
    """Sidecar bytes of a part's hashes (sorted and distinct)."""
    return np.unique(hashes).astype(_DTYPE, copy=False).tobytes()


class PartitionIndex:
    """The sidecars of one partition's committed parts, looked up once per landing run.

    A partition that was landed into many times without a compaction holds thousands of parts: small
    sidecars are read whole, larger ones are memory-mapped while they are searched and unmapped after (a
    map holds a descriptor of its own), so no descriptor stays open per part.
    """

    def __init__(self, lake: LakeFS, rel: str) -> None:
        self.lake, self.rel = lake, rel
        self.parts: list[tuple[str, str, np.ndarray | None]] = []  # (part, sidecar, its hashes unless mapped)
        self._confirmed: dict[str, set[str]] = {}  # call ids of parts a hash hit was confirmed in
        files = lake.list_files(rel, recursive=False)
        have = {f for f in files if f.endswith(SUFFIX)}
        for part in (f for f in files if f.endswith(_PARQUET)):
            side = sidecar(part)
            if side not in have:
                self._build(part, side)
            size = os.path.getsize(lake.full(side)) if lake.is_local else -1
            if size == 0:
                continue  # a part without calls
            arr = self._read(side) if size <= IN_MEMORY else None
            if arr is None or arr.size:
                self.parts.append((part, side, arr))

    def _build(self, part: str, side: str) -> None:
        ids = self.lake.read_parquet(part, columns=["call_id"]).column("call_id").to_pylist()
        try:
            self.lake.write_bytes(side, encode(hash_ids(c for c in ids if c is not None)))
        except OSError:  # a full disk: no half-written sidecar stays (the caller holds the lake's lock)
            manifest.sweep_temporary(self.lake, self.rel, prefix=posixpath.basename(side))
            raise
        log.info("built the call-id sidecar of %s (%d rows)", part, len(ids))

    def _read(self, side: str) -> np.ndarray:
        return np.frombuffer(self.lake.read_bytes(side), dtype=_DTYPE)

    def _mapped(self, side: str) -> np.ndarray:
        """A large sidecar's hashes, memory-mapped (unmapped with its last reference)."""
        try:
            return np.memmap(self.lake.full(side), dtype=_DTYPE, mode="r")
        except ValueError:  # an empty file cannot be mapped: a part without calls
            return np.empty(0, dtype=_DTYPE)

    def __bool__(self) -> bool:
        return bool(self.parts)

    def landed(self, call_ids: list[str], hashes: np.ndarray) -> set[str]:
        """The call ids among ``call_ids`` (with their ``hashes``) that a committed part already holds."""
        out: set[str] = set()
        if not self.parts or not call_ids:
            return out
        order = np.argsort(hashes, kind="stable")
        sorted_h = hashes[order]
        for part, side, held in self.parts:
            arr = self._mapped(side) if held is None else held
            if not arr.size:
                continue
            pos = np.searchsorted(arr, sorted_h)
            pos[pos == arr.size] = 0
            hit = arr[pos] == sorted_h
            if not hit.any():
                continue
            maybe = {call_ids[i] for i in order[hit].tolist()}
            # confirm against the part itself: a hash collision must never drop a call
            ids = self._confirmed.get(part)
            if ids is None:
                col = self.lake.read_parquet(part, columns=["call_id"]).column("call_id")
                ids = self._confirmed[part] = set(col.to_pylist())
            out |= maybe & ids
        return out
