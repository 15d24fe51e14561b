"""Read-only SQL over the lake: ad hoc queries, saved queries (sql/analytics) and audits (sql/audits).

Safety is two locks: only SELECT-like statements run (DuckDB's own parser says what a statement is),
and the connection may read files under the lake root only (``allowed_directories`` +
``enable_external_access = false``, then the configuration is locked).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import duckdb
import pyarrow as pa

from clawpipe import sqlfiles, tables
from clawpipe.errors import LakeError

_RETRIES = 3
_READ_ONLY = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}
_PARAM = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")
_COMMENT = re.compile(r"--[^\n]*")
_STRING = re.compile(r"'(?:[^']|'')*'")


def connect_read_only(lake_root: str | os.PathLike[str]) -> duckdb.DuckDBPyConnection:
    """A connection with the lake's views that can read nothing but the lake and change nothing."""
    lake = tables.LakeFS(lake_root)
    con = tables.connect(lake)
    allowed = [lake.url]
    if not lake.is_local:  # fsspec globs come back as scheme:///path as well as scheme://path
        allowed += [f"{lake.scheme}://{lake.root}", f"{lake.scheme}:///{lake.root.lstrip('/')}"]
    con.execute("set allowed_directories = ?", [sorted(set(allowed))])
    con.execute("set enable_external_access = false")
    con.execute("set lock_configuration = true")
    return con


def check_read_only(con: duckdb.DuckDBPyConnection, query: str) -> None:
    try:
        statements = con.extract_statements(query)
    except duckdb.Error as exc:
        raise LakeError(str(exc)) from exc
    if len(statements) != 1:
        raise LakeError(f"give exactly one statement (got {len(statements)})")
    kind = statements[0].type
    if kind not in _READ_ONLY:
        raise LakeError(f"the lake is read-only here: {kind.name} statements are refused; use SELECT")


def run_sql(lake_root: str | os.PathLike[str], query: str, params: dict[str, Any] | None = None) -> pa.Table:
    """Run one read-only statement over the lake's views and return the rows as Arrow."""
    for attempt in range(_RETRIES + 1):
        con = None
        try:
            # views resolve their globs when created, so a compaction that swaps a partition between the glob
            # and the read fails the connect or the query alike: a fresh try sees the new files
            con = connect_read_only(lake_root)
            check_read_only(con, query)
            return con.sql(query, params=params or None).to_arrow_table()
        except duckdb.IOException as exc:
            if attempt == _RETRIES:
                raise LakeError(str(exc).strip()) from exc
            time.sleep(0.05 * (attempt + 1))
        except duckdb.Error as exc:
            raise LakeError(str(exc).strip()) from exc
        finally:
            if con is not None:
                con.close()
    raise AssertionError("unreachable")


def query_params(sql: str) -> list[str]:
    """Names of the ``$name`` parameters a SQL text uses (outside comments and string literals)."""
    text = _STRING.sub("''", _COMMENT.sub("", sql))
    return sorted(set(_PARAM.findall(text)))


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
        raise LakeError(f"saved query {name} takes {', '.join(wanted) or 'no parameters'}; unknown: {unknown}")
    values = {k: (coerce_param(v) if isinstance(v, str) else v) for k, v in given.items()}
    return run_sql(lake_root, sql, {k: values.get(k) for k in wanted})


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
