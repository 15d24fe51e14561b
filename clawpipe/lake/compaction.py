"""Compaction: merge the many part files that landings leave in a partition into few large ones.

Row groups stream from the old files into new ones staged under ``<lake>/_staging``, dropping any
duplicate call (first landed wins); the partition directory is then exchanged with the staged one in
one atomic rename (local lakes, Linux ``renameat2``), so a reader sees the partition before or after
compaction, never half of it. Holds the lake's writer lock: landings wait, readers do not.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from clawpipe import schemas
from clawpipe.lake import manifest
from clawpipe.tables import STAGING, TMP_SUFFIX, LakeFS, conform

log = logging.getLogger(__name__)

COMPACTED = ("model_calls", "rejects")  # rollouts and tree tables are rewritten whole, never fragmented


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
    schema = schemas.TABLES[table]
    staged = f"{STAGING}/{uuid.uuid4().hex}"
    seen: set[str] = set()
    writer: pq.ParquetWriter | None = None
    out_rel = ""
    rows_in_file = 0
    written: list[str] = []
    for f in files:
        pf = pq.ParquetFile(lake.full(f), filesystem=lake.fs)
        for rg in range(pf.num_row_groups):
            t = conform(pf.read_row_group(rg), schema)  # files landed before a column was added
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
                    lake.move(out_rel + TMP_SUFFIX, out_rel)
                out_rel = f"{staged}/part-c{uuid.uuid4().hex}.parquet"
                writer = lake.open_parquet_writer(out_rel, schema)
                written.append(out_rel)
                rows_in_file = 0
            writer.write_table(t, row_group_size=1 << 20)
            rows_in_file += t.num_rows
            report.rows += t.num_rows
    if writer is not None:
        writer.close()
        lake.move(out_rel + TMP_SUFFIX, out_rel)
    if not written:
        lake.makedirs(staged)
    lake.swap_dir(staged, rel)
    lake.delete_dir(staged)
    report.partitions += 1
    report.files_before += len(files)
    report.files_after += len(written)


def compact(
    lake_root: str | os.PathLike[str], *, min_files: int = 2, max_rows_per_file: int = 2_000_000
) -> CompactionReport:
    """Compact every partition of model_calls (and the rejects table) holding ``min_files`` or more parts."""
    t0 = time.perf_counter()
    lake = LakeFS(lake_root)
    report = CompactionReport()
    with manifest.lake_lock(lake):
        manifest.load(lake)  # rolls back an interrupted landing first: only committed parts are merged
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
