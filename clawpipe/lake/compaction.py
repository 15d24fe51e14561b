"""Compaction: merge the many part files that landings leave in a partition into few large ones.

Row groups stream from the old files into new ones staged under ``<lake>/_staging``, dropping any
duplicate call (first landed wins); the partition directory is then exchanged with the staged one in
one atomic rename (local lakes, Linux ``renameat2``), so a reader sees the partition before or after
compaction, never half of it. Holds the lake's writer lock: landings wait, readers do not.

Object stores have no directory rename. There the merged files are written beside the old ones under a
name readers do not match, and a compaction record ``_manifest/compact-<id>.json`` (old files, new files)
is written before any of them is published; then the new files are published and the old ones deleted.
Readers' file lists (:func:`clawpipe.tables.table_files`) apply the record: old files while any new one
is missing, new files once all are there, so a reader never sees a row twice or not at all. A compaction
killed part-way is finished or undone by the next one (:func:`finish_interrupted`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import time
import uuid
from dataclasses import dataclass

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from clawpipe import capture, schemas
from clawpipe.errors import LakeError
from clawpipe.lake import manifest
from clawpipe.tables import COMPACT_PREFIX, TMP_SUFFIX, LakeFS, conform, keep_unknown_columns, locked_staging

log = logging.getLogger(__name__)

# rollouts merge their own parts as they land (clawpipe/lake/rollouts.py); tree tables are rewritten whole
COMPACTED = ("model_calls", "rejects")


@dataclass
class CompactionReport:
    partitions: int = 0
    files_before: int = 0
    files_after: int = 0
    rows: int = 0
    duplicates_dropped: int = 0
    seconds: float = 0.0


def _partition_dirs(lake: LakeFS, table: str) -> list[str]:
    if table == "rejects":
        return ["rejects"] if lake.exists("rejects") else []
    out = []
    for run in lake.list_dirs(table):
        for it in lake.list_dirs(f"{table}/{run}"):
            out.append(f"{table}/{run}/{it}")
    return out


def _compact_dir(lake: LakeFS, table: str, rel: str, files: list[str], max_rows: int, report: CompactionReport) -> None:
    # object stores: merged files go beside the old ones, unpublished, until the compaction record exists
    staged = locked_staging() if lake.is_local else rel  # a kill leaves it to the next lock holder to remove
    written: list[str] = []
    try:
        _merge(lake, table, rel, files, max_rows, report, staged, written)
    except (OSError, MemoryError, pa.ArrowException) as exc:
        # the partition was not touched yet: drop what was staged (space comes back) and say why
        message = _stopped(lake, rel, exc)
        if lake.is_local:
            lake.delete_dir(staged)
        else:
            for f in written:
                lake.delete(f + TMP_SUFFIX)
        raise LakeError(message) from exc
    report.partitions += 1
    report.files_before += len(files)
    report.files_after += len(written)


def _stopped(lake: LakeFS, rel: str, exc: OSError | MemoryError | pa.ArrowException) -> str:
    if isinstance(exc, OSError):
        why = capture.write_failure(exc, lake.root) if lake.is_local else str(exc)
    elif isinstance(exc, MemoryError):
        why = f"out of memory ({str(exc) or 'MemoryError'})"
    else:  # a value that does not cast to its column's type: a part another clawpipe version wrote
        why = (
            f"a part holds a column of another type than this clawpipe's schema ({exc}); it was written by another "
            "clawpipe version, which should compact it"
        )
    return (
        f"compacting {lake.url}/{rel} stopped: {why}. The partition is unchanged (the merged files were removed); "
        "run the compaction again once that is fixed"
    )


def _merge(
    lake: LakeFS,
    table: str,
    rel: str,
    files: list[str],
    max_rows: int,
    report: CompactionReport,
    staged: str,
    written: list[str],
) -> None:
    """Merge ``files`` into new ones under ``staged`` (their names appended to ``written``) and put them in place."""
    # every column of every part: the schema's (NULL in parts landed before a column was added) and those
    # a later clawpipe added, so the merged files hold all that the parts held
    file_schemas = [pq.read_schema(lake.full(f), filesystem=lake.fs) for f in files]
    schema = keep_unknown_columns(schemas.TABLES[table], file_schemas, f"{lake.url}/{rel}")
    seen: set[str] = set()
    writer: pq.ParquetWriter | None = None
    out_rel = ""
    rows_in_file = 0
    for f in files:
        pf = pq.ParquetFile(lake.full(f), filesystem=lake.fs)
        for rg in range(pf.num_row_groups):
            t = conform(pf.read_row_group(rg), schema)
            if table == "model_calls":
                ids = t.column("call_id").to_pylist()
                # rows of one call are contiguous and land together: a call already seen is a duplicate
                keep = []
                fresh: set[str] = set()
                for c in ids:
                    ok = c not in seen
                    keep.append(ok)
                    if ok:
                        fresh.add(c)
                seen |= fresh
                if not all(keep):
                    report.duplicates_dropped += keep.count(False)
                    t = t.filter(pa.array(keep))
            if t.num_rows == 0:
                continue
            if writer is None or rows_in_file >= max_rows:
                if writer is not None:
                    writer.close()
                    if lake.is_local:
                        lake.move(out_rel + TMP_SUFFIX, out_rel)
                out_rel = f"{staged}/part-c{uuid.uuid4().hex}.parquet"
                writer = lake.open_parquet_writer(out_rel, schema)
                written.append(out_rel)
                rows_in_file = 0
            try:
                writer.write_table(t, row_group_size=1 << 20)
            except BaseException:
                with contextlib.suppress(Exception):  # a writer whose disk filled may fail to close as well
                    writer.close()
                raise
            rows_in_file += t.num_rows
            report.rows += t.num_rows
    if writer is not None:
        writer.close()
        if lake.is_local:
            lake.move(out_rel + TMP_SUFFIX, out_rel)
    if lake.is_local:
        if not written:
            lake.makedirs(staged)
        lake.swap_dir(staged, rel)
        lake.delete_dir(staged)
    else:
        _exchange_remote(lake, files, written)


def _exchange_remote(lake: LakeFS, old: list[str], new: list[str]) -> None:
    """Replace ``old`` by ``new`` (written unpublished) on an object store, behind a compaction record."""
    record = f"{COMPACT_PREFIX}{uuid.uuid4().hex}.json"
    lake.write_bytes(record, orjson.dumps({"old": old, "new": new}))
    for f in new:
        lake.move(f + TMP_SUFFIX, f)
    for f in old:
        lake.delete(f)
    # the record stays until the next compaction: a reader that listed while this one ran sees it, lists again


def finish_interrupted(lake: LakeFS) -> int:
    """Finish (all new files published) or undo (otherwise) the recorded compactions and remove their
    records; returns how many a kill had left part-way."""
    interrupted = 0
    prefix_dir = posixpath.dirname(COMPACT_PREFIX)
    records = [f for f in lake.list_files(prefix_dir, suffix=".json", recursive=False) if f.startswith(COMPACT_PREFIX)]
    for record in records:
        entry = orjson.loads(lake.read_bytes(record))
        new, old = entry.get("new", []), entry.get("old", [])
        if all(lake.exists(f) for f in new):
            left = [f for f in old if lake.exists(f)]
            for f in left:
                lake.delete(f)
            interrupted += bool(left)
        else:
            for f in new:
                lake.delete(f)
                lake.delete(f + TMP_SUFFIX)
            interrupted += 1
        lake.delete(record)
    if interrupted:
        log.warning("finished or undid %d interrupted compactions", interrupted)
    return interrupted


def compact(
    lake_root: str | os.PathLike[str], *, min_files: int = 2, max_rows_per_file: int = 2_000_000
) -> CompactionReport:
    """Compact every partition of model_calls (and the rejects table) holding ``min_files`` or more parts."""
    t0 = time.perf_counter()
    lake = LakeFS(lake_root)
    report = CompactionReport()
    with manifest.lake_lock(lake) as lease:
        manifest.load(lake, lease)  # rolls back an interrupted landing first: only committed parts are merged
        if not lake.is_local:
            finish_interrupted(lake)
        for table in COMPACTED:
            for rel in _partition_dirs(lake, table):
                files = lake.list_files(rel, suffix=".parquet")
                if len(files) >= min_files:
                    _compact_dir(lake, table, rel, files, max_rows_per_file, report)
    report.seconds = time.perf_counter() - t0
    log.info(
        "compacted partitions=%d files %d -> %d rows=%d duplicates_dropped=%d in %.2fs",
        report.partitions,
        report.files_before,
        report.files_after,
        report.rows,
        report.duplicates_dropped,
        report.seconds,
    )
    return report
