"""Read-only SQL over the lake: ad hoc queries, saved queries (sql/analytics) and audits (sql/audits).

Read-only by construction, in two locks. The statement: exactly one, and DuckDB's own parser must call it
a SELECT (no EXPLAIN, whose ANALYZE form executes its statement; no COPY, ATTACH, INSTALL, LOAD,
PRAGMA, SET, CALL or DDL). The connection: its views read a fixed list of the lake's Parquet files, those
files are the only paths it may open (``allowed_paths`` with ``enable_external_access = false``: no
other file, no directory listing, no writing anywhere, since DuckDB writes through a temporary name),
extensions are neither loaded nor installed, and the configuration is locked.

Bounded, since the lake's machine also runs rollouts and training: each query has a wall-clock limit
(``timeout_s``, default :data:`DEFAULT_TIMEOUT_S`; a watchdog thread interrupts it), a memory cap
(``memory_mb``, default a quarter of physical memory), a thread count (``threads``, default half the CPUs)
and a spill cap (``spill_mb``, default a quarter of the free space of the temporary folder; 0: no spilling).
Spilled data goes to a private folder under the system's temporary folder (``TMPDIR``), never inside the
lake, and is removed when the query ends. All are set before the configuration is locked.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from clawpipe import schemas, sqlfiles, tables
from clawpipe.errors import ConfigError, LakeError

_RETRIES = 3
DEFAULT_TIMEOUT_S = 300.0
_REINTERRUPT_S = 0.05
_LOCKS = (
    "set enable_external_access = false",  # file access only to allowed_paths; no extension loading
    "set autoload_known_extensions = false",
    "set autoinstall_known_extensions = false",
    "set allow_community_extensions = false",
    "set lock_configuration = true",  # last: nothing above can be undone by a statement
)


@dataclass(frozen=True)
class QueryLimits:
    """What one query may use: seconds (None: no limit), MB of memory, MB spilled to disk (0: none), threads."""

    timeout_s: float | None
    memory_mb: int
    spill_mb: int
    threads: int

    @classmethod
    def resolve(
        cls,
        timeout_s: float | None = None,
        memory_mb: int | None = None,
        spill_mb: int | None = None,
        threads: int | None = None,
    ) -> QueryLimits:
        """The limits a call gives, each checked, with the defaults for those it leaves None."""
        timeout = _number("timeout_s", "--timeout-s", DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
        return cls(
            timeout_s=timeout or None,  # 0 is the documented "no limit"
            memory_mb=_whole("memory_mb", "--memory-mb", memory_mb, 1, default_memory_mb, "4000"),
            spill_mb=_whole(
                "spill_mb", "--spill-mb", spill_mb, 0, lambda: default_spill_mb(tempfile.gettempdir()), "10000"
            ),
            threads=_whole("threads", "--threads", threads, 1, default_threads, "2"),
        )


def default_memory_mb() -> int:
    """A quarter of physical memory: the machine also runs rollouts and training."""
    import psutil

    return max(64, psutil.virtual_memory().total // 4 // 1_000_000)


def default_threads() -> int:
    """Half the CPUs this process may run on, at least one."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // 2)


def default_spill_mb(folder: str) -> int:
    """A quarter of the free space of the filesystem that holds ``folder``."""
    return shutil.disk_usage(folder).free // 4 // 1_000_000


def _number(name: str, option: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(
            f"{name}={value!r} is not a number of seconds >= 0; give e.g. {name}=600 ({option} 600), or 0 for no limit"
        )
    return float(value)


def _whole(name: str, option: str, value: Any, least: int, default: Callable[[], int], example: str) -> int:
    if value is None:
        return default()
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(
            f"{name}={value!r} is not a whole number >= {least}; give e.g. {name}={example} ({option} {example})"
        )
    return value


def _connect_pinned(
    lake: tables.LakeFS, limits: QueryLimits | None = None, spill_dir: str | None = None
) -> tuple[duckdb.DuckDBPyConnection, dict[str, list[str]]]:
    files = tables.table_files(lake)
    con = tables.connect(lake, files=files)
    allowed = {f for fs in files.values() for f in fs}
    if not lake.is_local:  # DuckDB names fsspec files scheme:///path as well as scheme://path
        allowed |= {f"{lake.scheme}:///{f.split('://', 1)[1].lstrip('/')}" for f in allowed}
    con.execute("set allowed_paths = ?", [sorted(allowed)])
    # spill only into spill_dir: without one DuckDB would write query data into ./.tmp (external access off
    # does not stop it). Set before the locks: with external access off it can no longer be changed.
    con.execute("set temp_directory = ?", [spill_dir or ""])
    if limits is not None:
        con.execute("set memory_limit = ?", [f"{limits.memory_mb}MB"])
        con.execute("set max_temp_directory_size = ?", [f"{limits.spill_mb if spill_dir else 0}MB"])
        con.execute("set threads = ?", [limits.threads])
    for lock in _LOCKS:
        con.execute(lock)
    return con, files


def _spill_folder(lake: tables.LakeFS, limits: QueryLimits) -> str | None:
    """A fresh private folder for the query's spilled data under the system's temporary folder, or None when
    spilling is off. Never inside the lake: a file there would be read as part of a table."""
    if limits.spill_mb == 0:
        return None
    parent = Path(tempfile.gettempdir()).resolve()
    if lake.is_local and parent.is_relative_to(Path(lake.root).resolve()):
        raise LakeError(
            f"the temporary folder {parent} (TMPDIR) lies inside the lake {lake.root}, where clawpipe sql writes "
            "nothing; point TMPDIR elsewhere, or turn spilling off (--spill-mb 0, spill_mb=0)"
        )
    return tempfile.mkdtemp(prefix="clawpipe-sql-", dir=parent)


class _Watchdog:
    """Interrupts a connection's query once its deadline passes, and again every few milliseconds until the
    call ends: DuckDB forgets an interrupt that arrives before its query starts. No thread without a deadline."""

    def __init__(self, con: duckdb.DuckDBPyConnection, deadline: float | None) -> None:
        self.fired = False
        self._con = con
        self._deadline = deadline
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="clawpipe-sql-watchdog", daemon=True)

    def __enter__(self) -> _Watchdog:
        if self._deadline is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        assert self._deadline is not None
        if self._done.wait(max(0.0, self._deadline - time.monotonic())):
            return
        self.fired = True
        while True:
            self._con.interrupt()
            if self._done.wait(_REINTERRUPT_S):
                return


def _timed_out(limits: QueryLimits) -> LakeError:
    assert limits.timeout_s is not None
    return LakeError(
        f"the query ran past its time limit of {limits.timeout_s:g} s and was stopped; raise the limit "
        f"(clawpipe sql --timeout-s N, or timeout_s=N; 0 for none) or filter or aggregate more"
    )


_NO_SPACE = "No space left on device"


def _no_space(exc: duckdb.IOException, limits: QueryLimits, spill_dir: str | None) -> str:
    where = f"the temporary folder {Path(spill_dir).parent} (TMPDIR)" if spill_dir else "a disk the query wrote to"
    return (
        f"{str(exc).strip()}: {where} has no room for the query's spilled data; free space there, point TMPDIR "
        f"at a larger disk, or lower the spill cap (now {limits.spill_mb} MB: --spill-mb N, or spill_mb=N)"
    )


def _out_of_memory(exc: duckdb.OutOfMemoryException, limits: QueryLimits, spilled: bool) -> LakeError:
    first = str(exc).splitlines()[0].rstrip(".")
    if "max_temp_directory_size" in str(exc) and spilled:
        cap = (
            f"the query spilled more than its spill cap of {limits.spill_mb} MB to disk; raise the cap "
            "(clawpipe sql --spill-mb N, or spill_mb=N)"
        )
    else:
        spill = f"its spill cap of {limits.spill_mb} MB" if spilled else "spilling off (spill_mb=0)"
        cap = (
            f"the query needs more than its memory cap of {limits.memory_mb} MB with {spill}; raise the cap "
            "(clawpipe sql --memory-mb N, or memory_mb=N)"
        )
    return LakeError(
        f"{first}: {cap}, or filter or aggregate more (e.g. by run_id and iteration), or select fewer columns"
    )


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
        name = "INSTALL and LOAD" if kind == duckdb.StatementType.LOAD else kind.name  # DuckDB calls both LOAD
        raise LakeError(f"the lake is read-only here: {name} statements are refused; use SELECT")


def run_sql(
    lake_root: str | os.PathLike[str],
    query: str,
    params: dict[str, Any] | None = None,
    *,
    timeout_s: float | None = None,
    memory_mb: int | None = None,
    spill_mb: int | None = None,
    threads: int | None = None,
) -> pa.Table:
    """Run one read-only statement over the lake's views and return the rows as Arrow.

    ``timeout_s`` (default :data:`DEFAULT_TIMEOUT_S`, 0 for none) bounds the whole call; ``memory_mb``,
    ``spill_mb`` (0: no spilling) and ``threads`` cap what the query may use (None: the defaults the module
    docstring names). A query past a limit fails with a :class:`LakeError` naming the limit and its option."""
    limits = QueryLimits.resolve(timeout_s, memory_mb, spill_mb, threads)
    deadline = None if limits.timeout_s is None else time.monotonic() + limits.timeout_s
    lake = tables.LakeFS(lake_root)
    spill_dir = _spill_folder(lake, limits)
    try:
        return _run_with_retries(lake, query, params, limits, deadline, spill_dir)
    finally:
        if spill_dir is not None:
            shutil.rmtree(spill_dir, ignore_errors=True)


def _run_with_retries(
    lake: tables.LakeFS,
    query: str,
    params: dict[str, Any] | None,
    limits: QueryLimits,
    deadline: float | None,
    spill_dir: str | None,
) -> pa.Table:
    for attempt in range(_RETRIES + 1):
        if deadline is not None and time.monotonic() >= deadline:
            raise _timed_out(limits)
        con = None
        files: dict[str, list[str]] | None = None
        watchdog = None
        try:
            # the views read the files listed at connect, so a compaction that swaps a partition between the
            # listing and the read fails the query (a file gone, or one not on the list): a fresh try sees the
            # new files
            con, files = _connect_pinned(lake, limits, spill_dir)
            check_read_only(con, query)
            with _Watchdog(con, deadline) as watchdog:
                return con.sql(query, params=params or None).to_arrow_table()
        except duckdb.Error as exc:
            if watchdog is not None and watchdog.fired:  # whatever the interrupt surfaced as, the time ran out
                raise _timed_out(limits) from exc
            if isinstance(exc, duckdb.IOException):
                if _NO_SPACE in str(exc):  # a full disk is no compaction race: trying again only spills again
                    raise LakeError(_no_space(exc, limits, spill_dir)) from exc
                if attempt == _RETRIES:
                    raise LakeError(str(exc).strip()) from exc
                time.sleep(0.05 * (attempt + 1))
                continue
            if isinstance(exc, duckdb.PermissionException):
                if attempt < _RETRIES and files is not None and files != tables.table_files(lake):
                    time.sleep(0.05 * (attempt + 1))
                    continue
                raise LakeError(f"{str(exc).strip()}; clawpipe sql reads the lake's tables and nothing else") from exc
            if isinstance(exc, duckdb.OutOfMemoryException):
                raise _out_of_memory(exc, limits, spilled=spill_dir is not None) from exc
            if isinstance(exc, duckdb.CatalogException) and "does not exist" in str(exc):
                # DuckDB suggests its own catalog's names (pg_sequences, ...): name the lake's instead
                first = str(exc).strip().splitlines()[0].rstrip("!")
                raise LakeError(f"{first}; the lake's tables: {', '.join(sorted(schemas.TABLES))}") from exc
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


def run_saved(
    lake_root: str | os.PathLike[str],
    name: str,
    params: dict[str, Any] | None = None,
    *,
    timeout_s: float | None = None,
    memory_mb: int | None = None,
    spill_mb: int | None = None,
    threads: int | None = None,
) -> pa.Table:
    """Run ``sql/analytics/<name>.sql``; parameters it uses but that are not given are NULL (no filter).
    The limits are :func:`run_sql`'s."""
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
    return run_sql(
        lake_root,
        sql,
        {k: typed_param(name, k, given.get(k)) for k in wanted},
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        spill_mb=spill_mb,
        threads=threads,
    )


def run_audits(
    lake_root: str | os.PathLike[str],
    *,
    timeout_s: float | None = 0,
    memory_mb: int | None = None,
    spill_mb: int | None = None,
    threads: int | None = None,
) -> dict[str, pa.Table]:
    """Every audit in sql/audits: name -> offending rows (an empty table is a pass).

    Each audit runs as :func:`run_sql` runs a query: read-only, retried across a compaction, under the same
    memory, spill and thread caps (so an audit over a large lake fails with a message rather than taking the
    machine's memory); ``timeout_s`` bounds each audit, none by default (0), since an audit reads whole tables.
    """
    out = {}
    for name in sqlfiles.sql_names("audits"):
        try:
            out[name] = run_sql(
                lake_root,
                sqlfiles.sql_text(f"audits/{name}"),
                timeout_s=timeout_s,
                memory_mb=memory_mb,
                spill_mb=spill_mb,
                threads=threads,
            )
        except LakeError as exc:
            raise LakeError(f"audit {name} failed: {exc}") from exc
    return out
