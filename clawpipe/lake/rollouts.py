"""Rollout result rows -> the ``rollouts`` table: each line checked against schemas.ROLLOUTS, and merged into
its partition so that per rollout_id the latest attempt wins."""

from __future__ import annotations

import uuid
from typing import Any

import pyarrow as pa

from clawpipe import schemas, tables
from clawpipe.lake import rows
from clawpipe.tables import LakeFS


def coerce_rollout(row: dict[str, Any]) -> dict[str, Any]:
    """A result line as a ``rollouts`` row; raises ValueError (:class:`rows.BadValue`) naming what is wrong."""
    out = rows.rollout_row(row)
    if not isinstance(out["rollout_id"], str) or not out["rollout_id"]:
        raise rows.BadValue("rollout rollout_id missing or not a string")
    rows.partition_name(out["run_id"], "rollout run_id")
    return out


def merge_rollouts(lake: LakeFS, run_id: str, iteration: int, new_rows: list[dict[str, Any]]) -> None:
    """Rewrite a rollouts partition with its rows plus ``new_rows``; per rollout_id the latest attempt wins
    (highest ``attempt``, then the later landed)."""
    rel = tables.partition_rel("rollouts", run_id, iteration)
    existing: list[dict[str, Any]] = []
    file_schemas: list[pa.Schema] = []
    for part in lake.list_files(rel, suffix=".parquet"):
        table = lake.read_parquet(part)
        file_schemas.append(table.schema)
        existing.extend(table.to_pylist())
    # columns a later clawpipe wrote stay with their rows (a new row has them NULL)
    schema = tables.keep_unknown_columns(schemas.ROLLOUTS, file_schemas, f"{lake.url}/{rel}")
    best: dict[str, tuple[tuple[int, int], dict[str, Any]]] = {}
    for order, row in enumerate(existing + new_rows):
        key = (row.get("attempt") or 0, order)
        cur = best.get(row["rollout_id"])
        if cur is None or key >= cur[0]:
            best[row["rollout_id"]] = (key, row)
    merged = [r for _, r in sorted(best.values(), key=lambda kv: kv[0][1])]
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
