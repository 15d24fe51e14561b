"""The commit protocol of a landing run: what one batch writes, and how it becomes visible all at once.

A :class:`Batch` collects the calls of every partition it meets (:class:`Partition`, rows buffered by
column name in :mod:`clawpipe.lake.columns`), the rejects, the rollout result rows and the source ranges
they came from. Rows are flushed as one Parquet row group per partition every ``row_group_bytes`` of
input into a part named ``.inprogress`` (listed in the batch's pending record first, so a kill leaves
nothing a later landing cannot roll back); :meth:`Batch.commit` closes the parts, renames them, writes
each part's call-id sidecar, merges the rollout rows and then commits one manifest entry that names
everything (:mod:`clawpipe.lake.manifest`). Calls a committed part already holds are dropped at flush
(counted as duplicates), so a landing killed anywhere and rerun ends with every call exactly once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import uuid
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from clawpipe import schemas, tables
from clawpipe.lake import id_index, manifest, rows
from clawpipe.lake.columns import CallColumns
from clawpipe.lake.rollouts import merge_rollouts
from clawpipe.tables import TMP_SUFFIX, LakeFS

log = logging.getLogger(__name__)

RECORD_PREVIEW = 2000
# Fault injection for the kill tests: SIGKILL this process right after publishing the parts of the
# N-th batch (1-based), before its commit: the worst moment to die.
_CRASH_ENV = "CLAWPIPE_LAKE_CRASH_BEFORE_COMMIT"

# Writer settings of model_calls parts (measured in bench/README.md): zstd level 1 (a faster level, -3,
# saved ~2 us of ~25 us of writing per small call and cost 38% more bytes); dictionaries only on the columns
# whose values repeat (never the per-call ids, offsets or times); min/max statistics on the columns queries
# filter or sort by.
_DICTIONARY = [
    "run_id", "rollout_id", "api", "path", "status", "error", "model", "finish_reason", "token_source", "segment",
]  # fmt: skip
_STATISTICS = ["call_id", "choice_index", "run_id", "iteration", "rollout_id", "seq", "status", "http_status",
               "policy_version", "proxy_policy_version", "token_source", "t_start", "t_end", "segment",
               "offset"]  # fmt: skip
CALLS_WRITER_OPTIONS: dict[str, Any] = {
    "compression": "zstd",
    "compression_level": 1,
    "use_dictionary": _DICTIONARY,
    "write_statistics": _STATISTICS,
}


class Partition:
    """One ``model_calls`` partition met by this landing run: its committed call ids, this run's buffered
    rows and its part in the batch under way."""

    def __init__(self, lake: LakeFS, run_id: str, iteration: int) -> None:
        self.run_id, self.iteration = run_id, iteration
        self.rel = tables.partition_rel("model_calls", run_id, iteration)
        # committed parts are checked through their id sidecars, a row group at a time (flush_rows);
        # this run's own calls through a set, as they are met
        self.index = id_index.PartitionIndex(lake, self.rel)
        self.seen: set[str] = set()
        self.columns = CallColumns()
        self.landed = 0  # calls landed into this partition by this run
        self.writer: pq.ParquetWriter | None = None
        self.part: str | None = None
        self.part_hashes: list[np.ndarray] = []  # id hashes of the calls written to ``part``


class Batch:
    """One unit of commit: parts per partition, rejects, rollout rows and the source ranges they cover."""

    def __init__(
        self,
        lake: LakeFS,
        state: manifest.ManifestState,
        partitions: dict[tuple[str, int], Partition],
        report: Any,
    ) -> None:
        self.lake, self.state, self.partitions, self.report = lake, state, partitions, report
        self.id = uuid.uuid4().hex
        self.parts: list[str] = []
        self.segments: dict[str, list[Any]] = {}  # key -> [start, end, done]
        self.results: dict[str, list[int]] = {}
        self.rejects: list[dict[str, Any]] = []
        self.rollout_rows: dict[tuple[str, int], list[dict[str, Any]]] = {}
        self.touched: set[Partition] = set()  # partitions this batch added calls to (each may hold a part open)
        self.bytes = 0
        self.buffered = 0
        self.empty = True

    # -- sources ------------------------------------------------------------------------------------
    def advance_segment(self, key: str, start: int, end: int, done: bool = False) -> None:
        if end <= start and not done:
            return
        rng = self.segments.get(key)
        if rng is None:
            self.segments[key] = [start, end, done]
        else:
            rng[1] = max(rng[1], end)
            rng[2] = rng[2] or done
        self.empty = False

    def advance_results(self, key: str, start: int, end: int) -> None:
        rng = self.results.setdefault(key, [start, end])
        rng[1] = end
        self.empty = False

    def reject(self, source: str, offset: int, reason: str, record: str | None) -> None:
        self.rejects.append(
            {
                "source": source,
                "offset": offset,
                "reason": reason,
                "record": None if record is None else record[:RECORD_PREVIEW],
                "landed_at": datetime.now(UTC),
            }
        )

    # -- rows ---------------------------------------------------------------------------------------
    def partition(self, run_id: Any, iteration: int) -> Partition:
        p = self.partitions.get((run_id, iteration))
        if p is None:
            if run_id.__class__ is not str:
                raise rows.BadValue(f"header run_id is a {type(run_id).__name__}, not a string")
            run_id = rows.partition_name(run_id, "header run_id")
            p = self.partitions[(run_id, iteration)] = Partition(self.lake, run_id, iteration)
        return p

    def flush_rows(self) -> None:
        """Write buffered rows as one row group per partition; calls with a list that does not fit become rejects."""
        for p in self.partitions.values():
            cols = p.columns
            if not len(cols):
                continue
            try:
                self._write_rows(p, cols)
            finally:
                p.columns = cols.emptied()  # the table is gone: its body buffers serve the next row group
        self.buffered = 0

    def _write_rows(self, p: Partition, cols: CallColumns) -> None:
        hashes = id_index.hash_ids(cols.call_ids)
        drop = self._drop_landed(p, cols, hashes)
        table = self._calls_table(p, cols, drop)
        if table is None:
            return
        if p.writer is None:
            p.part = f"{p.rel}/part-{self.id}.parquet"
            self.parts += [p.part, id_index.sidecar(p.part)]  # the sidecar commits (or rolls back) with it
            manifest.write_pending(self.lake, self.id, self.parts)
            p.writer = _open_writer(self.lake, p.part)
        p.writer.write_table(table, row_group_size=1 << 20)
        if drop:
            keep = np.ones(len(hashes), dtype=bool)
            keep[list(drop)] = False
            hashes = hashes[keep]
        p.part_hashes.append(hashes)

    def _drop_landed(self, p: Partition, cols: CallColumns, hashes: np.ndarray) -> set[int]:
        """The buffered calls a committed part already holds (counted as duplicates), by call index."""
        if not p.index:
            return set()
        dup = p.index.landed(cols.call_ids, hashes)
        if not dup:
            return set()
        drop = {i for i, c in enumerate(cols.call_ids) if c in dup}
        self.report.calls -= len(drop)
        self.report.rows -= sum(cols.call_rows[i] for i in drop)
        self.report.duplicates += len(drop)
        p.landed -= len(drop)  # they stay in p.seen: landed already, so any further copy is one too
        return drop

    def _calls_table(self, p: Partition, cols: CallColumns, drop: set[int]) -> pa.Table | None:
        """The partition's buffered rows as Arrow, less ``drop`` and the calls with a row that does not fit
        (rejected: added to ``drop``)."""
        try:
            return cols.table(drop)
        except rows.BadRows as exc:
            bad_rows = set(exc.bad)
            row_calls = cols.row_calls()
            bad: dict[int, tuple[int, str]] = {}  # call -> (its first bad row, reason)
            for i, reason in sorted(exc.bad.items()):
                bad.setdefault(int(row_calls[i]), (i, reason))
        for call, (row, reason) in bad.items():
            if call in drop:
                continue
            drop.add(call)
            response = cols.value("response", row) or b""
            self.reject(
                cols.value("segment", row),
                cols.value("offset", row),
                reason,
                f"{cols.call_ids[call]} {response[:RECORD_PREVIEW].decode('utf-8', 'replace')}",
            )
            self.report.rejects += 1
            self.report.calls -= 1
            self.report.rows -= cols.call_rows[call]
            p.seen.discard(cols.call_ids[call])
            p.landed -= 1
        if len(drop) == len(cols):
            return None
        return cols.table(drop, blank=bad_rows)

    def commit(self, report: Any) -> None:
        """Publish the batch and commit its manifest entry; a failure before the entry exists (a full disk)
        rolls the batch back at once (:meth:`rollback`), so none of it stays visible. Folding entries into a
        checkpoint afterwards may fail without harm: the entries stay and are folded by a later commit."""
        if self.empty and not self.rejects:
            return
        seq_before = self.state.seq
        try:
            self._publish(report)
        except BaseException:
            if self.state.seq == seq_before:  # the entry was not made: nothing of this batch may count
                self.rollback()
            raise
        if self.state.n_entries >= manifest.CHECKPOINT_EVERY:
            try:
                manifest.checkpoint(self.lake, self.state)
            except OSError as exc:
                manifest.sweep_temporary(self.lake, manifest.DIR)
                log.warning("could not fold the manifest into a checkpoint (kept as entries): %s", exc)

    def rollback(self) -> None:
        """Undo this uncommitted batch now: close its writers and delete its parts (published or not), their
        sidecars and temporary files, then its pending record. Space comes back and readers see nothing of it."""
        for p in self.partitions.values():
            if p.writer is not None:
                with contextlib.suppress(Exception):  # a writer whose disk filled may fail to close as well
                    p.writer.close()
                p.writer, p.part, p.part_hashes = None, None, []
        for part in self.parts:
            self.lake.delete(part)
            self.lake.delete(part + TMP_SUFFIX)
        # temporary files of this run's writes: its parts' and sidecars' (also a sidecar built for a part
        # landed before), and manifest records'; only lock holders write there
        folders = {posixpath.dirname(part) for part in self.parts} | {p.rel for p in self.partitions.values()}
        for folder in (*sorted(folders), manifest.DIR):
            manifest.sweep_temporary(self.lake, folder)
        self.lake.delete(f"{manifest.DIR}/pending-{self.id}.json")

    def _publish(self, report: Any) -> None:
        self.flush_rows()
        if self.rejects:
            part = f"rejects/part-{self.id}.parquet"
            self.parts.append(part)
            manifest.write_pending(self.lake, self.id, self.parts)
            self.lake.write_parquet(part, pa.Table.from_pylist(self.rejects, schema=schemas.REJECTS))
        manifest.check_writer(self.state)  # an object-store lease must still be ours before parts show
        for p in self.partitions.values():
            if p.writer is not None and p.part is not None:
                p.writer.close()
                self.lake.move(p.part + TMP_SUFFIX, p.part)
                self.lake.write_bytes(id_index.sidecar(p.part), id_index.encode(np.concatenate(p.part_hashes)))
                p.writer, p.part, p.part_hashes = None, None, []
        for (run_id, iteration), new_rows in self.rollout_rows.items():
            merge_rollouts(self.lake, run_id, iteration, new_rows)
        report.batches += 1
        if os.environ.get(_CRASH_ENV) == str(report.batches):
            os.kill(os.getpid(), 9)
        entry = {"segments": self.segments, "results": self.results, "parts": self.parts}
        manifest.commit(self.lake, self.id, entry, self.state)
        self.state.merge(entry)
        self.state.n_entries += 1


def _open_writer(lake: LakeFS, rel: str) -> pq.ParquetWriter:
    """A model_calls part writer on ``rel + TMP_SUFFIX`` with the landing's settings."""
    parent = posixpath.dirname(rel)
    if parent:
        lake.makedirs(parent)
    return pq.ParquetWriter(
        lake.full(rel + TMP_SUFFIX), schemas.MODEL_CALLS, filesystem=lake.fs, **CALLS_WRITER_OPTIONS
    )
