"""Rollout result rows -> the ``rollouts`` table: each line checked against schemas.ROLLOUTS, and merged into
its partition so that per rollout_id the latest attempt wins.

A partition holds each rollout_id once, in one of its part files. A landing whose rows are all new to the
partition (the usual case: results of rollouts that just finished) adds them as one more part, reading only
the ``rollout_id`` and ``attempt`` columns of the parts already there, so N landings of an iteration's results
cost the rows they bring, not N times the partition. Only a landing that brings a later attempt of a rollout
the partition holds (a retry) rewrites the partition, atomically, with that row replaced; a stale attempt
(lower than the held one) is dropped. Compaction merges the parts (:mod:`clawpipe.lake.compaction`).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from clawpipe import schemas, tables
from clawpipe.lake import rows
from clawpipe.tables import TMP_SUFFIX, LakeFS

log = logging.getLogger(__name__)

KEY_COLUMNS = ("rollout_id", "attempt")  # all a landing reads of the rows a partition holds already


def coerce_rollout(row: dict[str, Any]) -> dict[str, Any]:
    """A result line as a ``rollouts`` row; raises ValueError (:class:`rows.BadValue`) naming what is wrong."""
    out = rows.rollout_row(row)
    if not isinstance(out["rollout_id"], str) or not out["rollout_id"]:
        raise rows.BadValue("rollout rollout_id missing or not a string")
    rows.partition_name(out["run_id"], "rollout run_id")
    return out


def _latest(ordered: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per rollout_id the row with the highest attempt, the later of equal ones (insertion order kept)."""
    best: dict[str, dict[str, Any]] = {}
    for row in ordered:
        cur = best.get(row["rollout_id"])
        if cur is None or (row.get("attempt") or 0) >= (cur.get("attempt") or 0):
            best[row["rollout_id"]] = row
    return best


def held_attempts(lake: LakeFS, rel: str, parts: list[str]) -> dict[str, int]:
    """rollout_id -> attempt of the rows the ``parts`` of the partition at ``rel`` hold (their key columns only;
    a part written before ``attempt`` existed counts as attempt 0)."""
    held: dict[str, int] = {}
    for part in parts:
        names = pq.read_schema(lake.full(part), filesystem=lake.fs).names
        table = lake.read_parquet(part, columns=[c for c in KEY_COLUMNS if c in names])
        ids = table.column("rollout_id").to_pylist()
        attempts = table.column("attempt").to_pylist() if "attempt" in names else [0] * len(ids)
        for rid, attempt in zip(ids, attempts, strict=True):
            a = attempt or 0
            if rid not in held or a >= held[rid]:
                held[rid] = a
    return held


def merge_rollouts(lake: LakeFS, run_id: str, iteration: int, new_rows: list[dict[str, Any]]) -> None:
    """Merge ``new_rows`` into their rollouts partition; per rollout_id the latest attempt wins (highest
    ``attempt``, then the later landed). Rows new to the partition become one more part; a retry of a row it
    holds rewrites it (:func:`_rewrite`)."""
    rel = tables.partition_rel("rollouts", run_id, iteration)
    fresh = _latest(new_rows)
    files = lake.list_files(rel, recursive=False)
    for left in (f for f in files if f.endswith(TMP_SUFFIX)):
        lake.delete(left)  # a part whose append was killed mid-write (only the lake's lock holder writes here)
    parts = [f for f in files if f.endswith(".parquet")]
    held = held_attempts(lake, rel, parts)
    if any(rid in held and (row.get("attempt") or 0) >= held[rid] for rid, row in fresh.items()):
        _rewrite(lake, rel, parts, new_rows)
        return
    added = [row for rid, row in fresh.items() if rid not in held]  # the others are stale attempts: dropped
    if added:
        _append(lake, f"{rel}/part-{uuid.uuid4().hex}.parquet", pa.Table.from_pylist(added, schema=schemas.ROLLOUTS))


def _append(lake: LakeFS, part: str, table: pa.Table) -> None:
    """Publish ``table`` as the part ``part`` (renamed into place whole), leaving no temporary file when the
    write fails (a full disk)."""
    try:
        lake.write_parquet(part, table)
    except BaseException:
        lake.delete(part + TMP_SUFFIX)
        raise


def _rewrite(lake: LakeFS, rel: str, parts: list[str], new_rows: list[dict[str, Any]]) -> None:
    """Rewrite the partition at ``rel`` as one part of its rows and ``new_rows``, the latest attempt of each
    rollout_id (a landing that brings a retry of a row the partition holds)."""
    existing: list[dict[str, Any]] = []
    file_schemas: list[pa.Schema] = []
    for part in parts:
        table = lake.read_parquet(part)
        file_schemas.append(table.schema)
        existing.extend(table.to_pylist())
    # columns a later clawpipe wrote stay with their rows (a new row has them NULL)
    schema = tables.keep_unknown_columns(schemas.ROLLOUTS, file_schemas, f"{lake.url}/{rel}")
    merged = list(_latest(existing + new_rows).values())
    log.info("rewrote rollouts partition %s: %d rows, a later attempt of a rollout it held", rel, len(merged))
    _replace(lake, rel, pa.Table.from_pylist(merged, schema=schema))


def _replace(lake: LakeFS, rel: str, table: pa.Table) -> None:
    """Swap the partition at ``rel`` for one file of ``table`` (:func:`clawpipe.tables.replace_partition`'s way),
    removing the staged copy also when writing it fails (a full disk keeps no half-written file)."""
    staged = f"{tables.STAGING}/{uuid.uuid4().hex}"
    try:
        lake.write_parquet(f"{staged}/part-{uuid.uuid4().hex}.parquet", table)
        lake.swap_dir(staged, rel)
    finally:
        lake.delete_dir(staged)
