"""Rollout result rows -> the ``rollouts`` table: each line checked against schemas.ROLLOUTS, and merged into
its partition so that per rollout_id the latest attempt wins.

A partition holds each rollout_id once. A landing reads only the ``rollout_id`` and ``attempt`` columns of the
rows landed before, then writes its rows as a new part merged with the partition's small parts: the parts it
takes are those no larger than what is merged so far (smallest first), so part sizes grow geometrically, a
partition holds a few parts (about log2 of its landings) and each row is rewritten a few times over the
partition's life. N landings of an iteration's results (async mode lands every few seconds) therefore cost
about their own rows each, not the partition. A part holding a row that a landed row supersedes (a retry: a
later or equal attempt) is merged too, without that row; a stale attempt is dropped. The partition changes in
one atomic swap (:meth:`clawpipe.tables.LakeFS.swap_dir`): its untouched parts are linked into the staged copy.
"""

from __future__ import annotations

import logging
import posixpath
import uuid
from typing import Any

import pyarrow as pa

from clawpipe import schemas, tables
from clawpipe.lake import rows
from clawpipe.tables import TMP_SUFFIX, LakeFS

log = logging.getLogger(__name__)

KEY_COLUMNS = ("rollout_id", "attempt")  # all a landing reads of the parts it does not merge


def coerce_rollout(row: dict[str, Any]) -> dict[str, Any]:
    """A result line as a ``rollouts`` row; raises ValueError (:class:`rows.BadValue`) naming what is wrong."""
    out = rows.rollout_row(row)
    if not isinstance(out["rollout_id"], str) or not out["rollout_id"]:
        raise rows.BadValue("rollout rollout_id missing or not a string")
    rows.partition_name(out["run_id"], "rollout run_id")
    return out


def _attempt(row: dict[str, Any]) -> int:
    return row.get("attempt") or 0


def _latest(ordered: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per rollout_id the row with the highest attempt, the later of equal ones."""
    best: dict[str, dict[str, Any]] = {}
    for row in ordered:
        cur = best.get(row["rollout_id"])
        if cur is None or _attempt(row) >= _attempt(cur):
            best[row["rollout_id"]] = row
    return best


def _keys(lake: LakeFS, part: str) -> tuple[list[str], list[int]]:
    """The rollout ids and attempts a part holds (a part written before ``attempt`` existed: attempt 0)."""
    try:
        table = lake.read_parquet(part, columns=list(KEY_COLUMNS))
    except pa.ArrowInvalid:  # no attempt column
        ids = lake.read_parquet(part, columns=["rollout_id"]).column("rollout_id").to_pylist()
        return ids, [0] * len(ids)
    return table.column("rollout_id").to_pylist(), [a or 0 for a in table.column("attempt").to_pylist()]


def merge_rollouts(lake: LakeFS, run_id: str, iteration: int, new_rows: list[dict[str, Any]]) -> None:
    """Merge ``new_rows`` into their rollouts partition; per rollout_id the latest attempt wins (highest
    ``attempt``, then the later landed)."""
    rel = tables.partition_rel("rollouts", run_id, iteration)
    files = lake.list_files(rel, recursive=False)
    for left in (f for f in files if f.endswith(TMP_SUFFIX)):
        lake.delete(left)  # a write killed before its swap (only the lake's lock holder writes here)
    held: dict[str, tuple[int, str]] = {}  # rollout_id -> (attempt, part)
    sizes: dict[str, int] = {}
    for part in (f for f in files if f.endswith(".parquet")):
        ids, attempts = _keys(lake, part)
        sizes[part] = len(ids)
        for rid, attempt in zip(ids, attempts, strict=True):
            held[rid] = (attempt, part)
    fresh = [
        row for rid, row in _latest(new_rows).items() if rid not in held or _attempt(row) >= held[rid][0]
    ]  # the others are stale attempts: dropped
    if not fresh:
        return
    superseded = {held[r["rollout_id"]][1] for r in fresh if r["rollout_id"] in held}
    take = _parts_to_merge(sizes, len(fresh), superseded)
    _write(lake, rel, list(sizes), take, fresh)


def _parts_to_merge(sizes: dict[str, int], n_new: int, must: set[str]) -> list[str]:
    """The parts to rewrite with ``n_new`` rows: those in ``must``, then the smallest others while each holds
    no more rows than all taken so far (a binary counter: few parts, each row rewritten a few times)."""
    take = sorted(must)
    merged = n_new + sum(sizes[p] for p in take)
    for part, n in sorted(((p, n) for p, n in sizes.items() if p not in must), key=lambda pn: (pn[1], pn[0])):
        if n > merged:
            break
        take.append(part)
        merged += n
    return take


def _write(lake: LakeFS, rel: str, parts: list[str], take: list[str], fresh: list[dict[str, Any]]) -> None:
    """Swap in the partition at ``rel`` holding its parts not in ``take`` as they are, and one part of the rows
    of ``take`` less those ``fresh`` supersedes, plus ``fresh``."""
    new_ids = {r["rollout_id"] for r in fresh}
    tables_in: list[pa.Table] = []
    for part in take:
        t = lake.read_parquet(part)
        keep = [rid not in new_ids for rid in t.column("rollout_id").to_pylist()]
        tables_in.append(t.filter(pa.array(keep, type=pa.bool_())))
    # columns a later clawpipe wrote stay with their rows (a new row has them NULL)
    schema = tables.keep_unknown_columns(schemas.ROLLOUTS, [t.schema for t in tables_in], f"{lake.url}/{rel}")
    merged = pa.concat_tables(
        [tables.conform(t, schema) for t in tables_in] + [pa.Table.from_pylist(fresh, schema=schema)]
    )
    if not take and parts:  # nothing rewritten: the part alone is published (renamed into place whole)
        part = f"{rel}/part-{uuid.uuid4().hex}.parquet"
        try:
            lake.write_parquet(part, merged)
        except BaseException:  # a full disk: no temporary file stays
            lake.delete(part + TMP_SUFFIX)
            raise
        return
    staged = tables.locked_staging()  # landing holds the lock: a kill leaves it to the next holder to remove
    try:
        lake.makedirs(staged)
        for part in parts:
            if part not in take:
                lake.link(part, f"{staged}/{posixpath.basename(part)}")
        lake.write_parquet(f"{staged}/part-{uuid.uuid4().hex}.parquet", merged)
        lake.swap_dir(staged, rel)
    finally:
        lake.delete_dir(staged)
    if take:
        log.debug("rollouts %s: %d rows landed, %d parts merged into %d rows", rel, len(fresh), len(take), len(merged))
