"""Read-only SQL over the lake: ad hoc queries, saved queries (sql/analytics) and audits (sql/audits).

Read-only by construction, in two locks. The statement: exactly one, and DuckDB's own parser must call it
a SELECT (no EXPLAIN, whose ANALYZE form executes its statement; no COPY, ATTACH, INSTALL, LOAD,
PRAGMA, SET, CALL or DDL). The connection: its views read a fixed list of the lake's Parquet files, those
files are the only paths it may open (``allowed_paths`` with ``enable_external_access = false``: no
other file, no directory listing, no writing anywhere, since DuckDB writes through a temporary name),
nothing spilled to a temporary directory, extensions are neither loaded nor installed, and the
configuration is locked.
"""

from __future__ import annotations

import math
import os
import re
import time
from typing import Any

import duckdb
import pyarrow as pa

from clawpipe import schemas, sqlfiles, tables
from clawpipe.errors import LakeError

_RETRIES = 3
_LOCKS = (
    # no spilling: DuckDB would write query data into ./.tmp (external access off does not stop it); a query
    # larger than memory fails instead. Set first: with external access off it can no longer be changed.
    "set temp_directory = ''",
    "set enable_external_access = false",  # file access only to allowed_paths; no extension loading
    "set autoload_known_extensions = false",
    "set autoinstall_known_extensions = false",
    "set allow_community_extensions = false",
    "set lock_configuration = true",  # last: nothing above can be undone by a statement
)


def connect_read_only(lake_root: str | os.PathLike[str]) -> duckdb.DuckDBPyConnection:
    """A connection with the lake's views that can read nothing but the lake's Parquet files and write nothing."""
    return _connect_pinned(tables.LakeFS(lake_root))[0]


def _connect_pinned(lake: tables.LakeFS) -> tuple[duckdb.DuckDBPyConnection, dict[str, list[str]]]:
    files = tables.table_files(lake)
    con = tables.connect(lake, files=files)
    allowed = {f for fs in files.values() for f in fs}
    if not lake.is_local:  # DuckDB names fsspec files scheme:///path as well as scheme://path
        allowed |= {f"{lake.scheme}:///{f.split('://', 1)[1].lstrip('/')}" for f in allowed}
    con.execute("set allowed_paths = ?", [sorted(allowed)])
    for lock in _LOCKS:
        con.execute(lock)
    return con, files


def check_read_only(con: duckdb.DuckDBPyConnection, query: str) -> None:
    """Refuse anything but exactly one SELECT, as DuckDB's parser classifies it."""
    try:
        statements = con.extract_statements(query)
    except duckdb.Error as exc:
        raise LakeError(str(exc).strip()) from exc
    if len(statements) != 1:
        raise LakeError(f"give exactly one statement (got {len(statements)})")
    try:
        kind = statements[0].type
    except ValueError:  # a statement kind newer than the Python enum (e.g. UPDATE EXTENSIONS): not a SELECT
        raise LakeError("the lake is read-only here: only SELECT statements run; use SELECT") from None
    if kind == duckdb.StatementType.EXPLAIN:
        raise LakeError(
            "the lake is read-only here: EXPLAIN is refused (EXPLAIN ANALYZE runs its statement); use SELECT"
        )
    if kind == duckdb.StatementType.MULTI:  # DuckDB runs PIVOT as several statements (it creates a type first)
        raise LakeError(
            "the lake is read-only here: this runs as several statements (PIVOT without an IN list does); "
            "name the pivot's values (PIVOT t ON col IN ('a', 'b') USING ...) or use GROUP BY"
        )
    if kind != duckdb.StatementType.SELECT:
        raise LakeError(f"the lake is read-only here: {kind.name} statements are refused; use SELECT")


def run_sql(lake_root: str | os.PathLike[str], query: str, params: dict[str, Any] | None = None) -> pa.Table:
    """Run one read-only statement over the lake's views and return the rows as Arrow."""
    lake = tables.LakeFS(lake_root)
    for attempt in range(_RETRIES + 1):
        con = None
        files: dict[str, list[str]] | None = None
        try:
            # the views read the files listed at connect, so a compaction that swaps a partition between the
            # listing and the read fails the query (a file gone, or one not on the list): a fresh try sees the
            # new files
            con, files = _connect_pinned(lake)
            check_read_only(con, query)
            return con.sql(query, params=params or None).to_arrow_table()
        except duckdb.IOException as exc:
            if attempt == _RETRIES:
                raise LakeError(str(exc).strip()) from exc
            time.sleep(0.05 * (attempt + 1))
        except duckdb.PermissionException as exc:
            if attempt < _RETRIES and files is not None and files != tables.table_files(lake):
                time.sleep(0.05 * (attempt + 1))
                continue
            raise LakeError(f"{str(exc).strip()}; clawpipe sql reads the lake's tables and nothing else") from exc
        except duckdb.OutOfMemoryException as exc:
            raise LakeError(
                f"{str(exc).splitlines()[0]}: the query needs more memory than DuckDB may use, and clawpipe sql "
                "writes nothing to disk; filter or aggregate more (e.g. by run_id and iteration), or select fewer "
                "columns"
            ) from exc
        except duckdb.Error as exc:
            raise LakeError(str(exc).strip()) from exc
        finally:
            if con is not None:
                con.close()
    raise AssertionError("unreachable")


def query_params(sql: str) -> list[str]:
    """Names of the ``$name`` parameters a SQL text uses, as DuckDB's parser finds them: not those in a
    comment of either kind, a string or a quoted name, each of which DuckDB would refuse as an extra value."""
    con = duckdb.connect()
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise LakeError(str(exc).strip()) from exc
    finally:
        con.close()
    return sorted({name for statement in statements for name in statement.named_parameters})


def coerce_param(value: str) -> Any:
    """A --param value as DuckDB should see it: integer, float, or text ('null' is NULL)."""
    if value.lower() == "null":
        return None
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _column_types() -> dict[str, pa.DataType]:
    """Each lake column's type by name (the first table's where two tables share a name)."""
    types: dict[str, pa.DataType] = {}
    for schema in schemas.TABLES.values():
        for field in schema:
            types.setdefault(field.name, field.type)
    return types


_COLUMN_TYPES = _column_types()


def typed_param(query: str, name: str, value: Any) -> Any:
    """A saved query's parameter as the lake column of its name holds it: a run id that reads ``42`` stays text
    (compared as a number it would fail on every other run id), ``iteration=abc`` is an error naming the
    parameter. Parameters named after no column are guessed by :func:`coerce_param`; ``null`` is NULL."""
    if value is None or (isinstance(value, str) and value.lower() == "null"):
        return None
    kind = _COLUMN_TYPES.get(name)
    if kind is None:
        return coerce_param(value) if isinstance(value, str) else value
    if pa.types.is_string(kind):
        return str(value)
    parsed = _parse(kind, str(value).strip())
    if parsed is None:
        word, example = (
            ("true or false", "true")
            if pa.types.is_boolean(kind)
            else ("a finite number", "0.5")
            if pa.types.is_floating(kind)
            else ("a whole number", "3")
        )
        raise LakeError(
            f"saved query {query}: {name}={value!r} is not {word} (the {name} column holds {kind}); "
            f"give e.g. --param {name}={example}, or {name}=null for no filter"
        )
    return parsed


def _parse(kind: pa.DataType, text: str) -> Any:
    """``text`` as a value of ``kind``; None when it is not one."""
    if pa.types.is_integer(kind):
        return int(text) if re.fullmatch(r"[+-]?[0-9]+", text) else None
    if pa.types.is_floating(kind):
        try:
            number = float(text)
        except ValueError:
            return None
        return number if math.isfinite(number) else None
    if pa.types.is_boolean(kind):
        return {"true": True, "false": False}.get(text.lower())
    return text  # timestamps and the like: DuckDB casts the text


def saved_names() -> list[str]:
    return sqlfiles.sql_names("analytics")


def run_saved(lake_root: str | os.PathLike[str], name: str, params: dict[str, Any] | None = None) -> pa.Table:
    """Run ``sql/analytics/<name>.sql``; parameters it uses but that are not given are NULL (no filter)."""
    if name not in saved_names():
        raise LakeError(f"no saved query {name!r}; saved queries: {', '.join(saved_names())}")
    sql = sqlfiles.sql_text(f"analytics/{name}")
    wanted = query_params(sql)
    given = dict(params or {})
    unknown = sorted(set(given) - set(wanted))
    if unknown:
        raise LakeError(
            f"saved query {name} takes {', '.join(wanted) or 'no parameters'}; unknown: {unknown} "
            "(`clawpipe lake saved` lists each query's parameters)"
        )
    return run_sql(lake_root, sql, {k: typed_param(name, k, given.get(k)) for k in wanted})


def run_audits(lake_root: str | os.PathLike[str]) -> dict[str, pa.Table]:
    """Every audit in sql/audits: name -> offending rows (an empty table is a pass)."""
    con = connect_read_only(lake_root)
    try:
        out = {}
        for name in sqlfiles.sql_names("audits"):
            try:
                out[name] = con.sql(sqlfiles.sql_text(f"audits/{name}")).to_arrow_table()
            except duckdb.Error as exc:
                raise LakeError(f"audit {name} failed: {exc}") from exc
        return out
    finally:
        con.close()
