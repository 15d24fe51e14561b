"""Lake access shared by every room: read views over the Parquet tables, and atomic partition writes.

Layout: ``<lake>/<table>/run_id=<R>/iteration=<I>/part-*.parquet``. Readers get an in-memory DuckDB
connection with one view per table over ``read_parquet(..., hive_partitioning=true, union_by_name=true)``,
so no writer ever holds a lock that blocks them (NOTES.md). A table with no files yet gets an empty view
with the right columns. Writers stage files outside the table and rename them into place.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from clawpipe.errors import LakeError
from clawpipe.schemas import TABLES

PARTITIONED = ("model_calls", "rollouts", "tree_nodes", "tree_stats")


def table_glob(lake_root: str | os.PathLike[str], table: str) -> str:
    if table in PARTITIONED:
        return f"{lake_root}/{table}/run_id=*/iteration=*/*.parquet"
    return f"{lake_root}/{table}/**/*.parquet"


def _has_files(lake_root: Path, table: str) -> bool:
    return any((lake_root / table).glob("**/*.parquet")) if (lake_root / table).is_dir() else False


def connect(lake_root: str | os.PathLike[str], *, tables: tuple[str, ...] | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with a view per lake table (local lakes)."""
    root = Path(lake_root)
    con = duckdb.connect()
    for name in tables or tuple(TABLES):
        if _has_files(root, name):
            # Paths are identifiers here, not values: DuckDB takes no parameters in view definitions.
            glob = table_glob(root, name).replace("'", "''")
            con.execute(
                f"create or replace view {name} as select * from read_parquet('{glob}', "
                "hive_partitioning=true, union_by_name=true)"
            )
        else:
            con.register(f"_{name}_empty", TABLES[name].empty_table())
            con.execute(f"create or replace view {name} as select * from _{name}_empty")
    return con


def partition_dir(lake_root: str | os.PathLike[str], table: str, run_id: str, iteration: int) -> Path:
    return Path(lake_root) / table / f"run_id={run_id}" / f"iteration={int(iteration)}"


def replace_partition(
    lake_root: str | os.PathLike[str], table: str, run_id: str, iteration: int, data: pa.Table
) -> Path:
    """Atomically replace one (run_id, iteration) partition of a table with ``data``.

    The new files are written to ``<lake>/_staging`` and swapped in with renames; a crash leaves either
    the old partition or the new one (or, between the two renames, none, which a rerun repairs), never a mix.
    """
    if table not in TABLES:
        raise LakeError(f"unknown table {table!r}; known: {sorted(TABLES)}")
    schema = TABLES[table]
    try:
        data = data.select(schema.names).cast(schema)
    except (KeyError, pa.ArrowInvalid) as exc:
        raise LakeError(f"rows for {table} do not match schemas.{table.upper()}: {exc}") from exc
    root = Path(lake_root)
    staging = root / "_staging" / uuid.uuid4().hex
    staging.mkdir(parents=True)
    pq.write_table(data, staging / f"part-{uuid.uuid4().hex}.parquet")
    target = partition_dir(root, table, run_id, iteration)
    target.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if target.exists():
        old = root / "_staging" / f"old-{uuid.uuid4().hex}"
        os.rename(target, old)
    os.rename(staging, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target
