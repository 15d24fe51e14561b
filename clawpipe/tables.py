"""Lake access shared by every room: read views over the Parquet tables, and atomic partition writes.

Layout: ``<lake>/<table>/run_id=<R>/iteration=<I>/part-*.parquet``; ``<lake>/rejects/part-*.parquet``.
Readers get an in-memory DuckDB connection with one view per table, defined in ``sql/views/<table>.sql``
over ``read_parquet(..., hive_partitioning=true, union_by_name=true)``, so no writer ever holds a lock
that blocks them (docs/ARCHITECTURE.md, pitfalls). A table with no files yet gets an empty view with the right columns.
Writers stage files under a name readers do not match and rename them into place.

Lakes written by other clawpipe versions (README, "Upgrading clawpipe"): a column of the schema that a file
lacks reads as NULL (or as derived from the column an earlier version wrote in its place, :data:`RENAMED`);
a column a file has that the schema lacks (written by a later version) is read as it is and kept by every
rewrite (:func:`keep_unknown_columns`); a lake whose format marker (``_manifest/format.json``) names a
later :data:`LAKE_FORMAT` is refused by readers and writers alike, naming the version that wrote it.

The lake root is a local path (default) or a filesystem URL: ``file:///abs/path`` or any fsspec URL
(``memory://lake``, ``s3://bucket/lake`` where s3fs is installed). :class:`LakeFS` hides the difference.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import posixpath
import uuid
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from clawpipe import __version__, objstore, sqlfiles
from clawpipe.errors import LakeError
from clawpipe.schemas import TABLES

PARTITIONED = ("model_calls", "rollouts", "tree_nodes", "tree_stats", "tree_sequences")
STAGING = "_staging"
# staging folders of writers that hold the lake's lock (compaction, the rollouts merge of a landing): the next
# holder removes what a killed one left (clawpipe/lake/manifest.py load); tree builds stage without the lock
LOCKED_STAGING = f"{STAGING}/locked-"
COMPACT_PREFIX = "_manifest/compact-"  # records of compactions under way on object stores
TMP_SUFFIX = ".inprogress"  # staged files end in this, so the views' ``*.parquet`` globs never match them
# Columns holding whole documents or token lists: no dictionary, no min/max statistics (both cost more
# than they give there: writing 150 KB responses with statistics was 3x slower).
BULK_COLUMNS = frozenset({"request", "response", "tool_calls", "reward_info", "stderr_tail", "record"})

# The lake's layout version. Added columns do not change it (older readers read them as they are); only a
# change an older clawpipe would misread (partition layout, manifest entries, a column's meaning) does.
LAKE_FORMAT = 1
FORMAT_FILE = "_manifest/format.json"  # {"format": N, "written_by": "clawpipe X.Y.Z"}; absent: format 1

# Columns an earlier version wrote in place of today's: {table: {old column: {new column: SQL over the
# old one}}}. Rows of such files read the new column from the expression; the old column stays readable.
RENAMED: dict[str, dict[str, dict[str, str]]] = {
    "tree_stats": {
        # one count of every call kept out of the trees, since split by kind: 0 splits as 0 and 0; a larger
        # count cannot be split, so the kinds stay NULL and the old total is still there to read
        "retokenized_calls": {
            "kept_out_retokenized": "case when retokenized_calls = 0 then 0 end",
            "kept_out_no_ids": "case when retokenized_calls = 0 then 0 end",
        },
    },
}


def locked_staging() -> str:
    """A fresh staging folder for a writer that holds the lake's lock (see :data:`LOCKED_STAGING`)."""
    return f"{LOCKED_STAGING}{uuid.uuid4().hex}"


def parquet_options(schema: pa.Schema) -> dict[str, object]:
    """Writer options for a table: zstd level 1, dictionaries and statistics on the small columns only."""
    small = [
        f.name
        for f in schema
        if f.name not in BULK_COLUMNS and not pa.types.is_list(f.type) and not pa.types.is_large_list(f.type)
    ]
    return {"compression": "zstd", "compression_level": 1, "use_dictionary": small, "write_statistics": small}


class LakeFS:
    """A lake root on a pyarrow filesystem. Paths given to methods are relative to the root ("a/b")."""

    def __init__(self, lake_root: str | os.PathLike[str]) -> None:
        text = os.fspath(lake_root)
        scheme = text.split("://", 1)[0] if "://" in text else ""
        self.scheme = scheme
        if scheme in ("", "file", "local"):
            self.fs: pafs.FileSystem = pafs.LocalFileSystem()
            base = text.split("://", 1)[1] if scheme else text
            self.root = str(Path(base).expanduser().resolve())
            self.is_local = True
            self.url = self.root  # what DuckDB reads
        else:
            from pyarrow.fs import FSSpecHandler, PyFileSystem

            fsspec_fs, path = objstore.filesystem(text)
            self.fsspec = fsspec_fs
            self.fs = PyFileSystem(FSSpecHandler(fsspec_fs))
            self.root = path.rstrip("/")
            self.is_local = False
            self.url = f"{scheme}://{self.root.lstrip('/')}" if scheme == "memory" else text.rstrip("/")

    def __repr__(self) -> str:
        return f"LakeFS({self.url!r})"

    # -- paths --------------------------------------------------------------------------------------
    def full(self, rel: str) -> str:
        return posixpath.join(self.root, rel) if rel else self.root

    def file_url(self, rel: str) -> str:
        """What DuckDB reads for the file at ``rel``: its path, or its URL on a remote lake."""
        return self.full(rel) if self.is_local else f"{self.url}/{rel}"

    def local_path(self, rel: str = "") -> Path:
        if not self.is_local:
            raise LakeError(f"{self.url} is not a local lake")
        return Path(self.full(rel))

    # -- queries ------------------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        return self.fs.get_file_info(self.full(rel)).type != pafs.FileType.NotFound

    def list_files(self, rel: str, *, suffix: str = "", recursive: bool = True) -> list[str]:
        """Relative paths of the files under ``rel`` ending in ``suffix`` (sorted); [] when absent."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.full(rel), allow_not_found=True, recursive=recursive))
        root = self.root.rstrip("/") + "/"
        out = []
        for info in infos:
            if info.type == pafs.FileType.File and info.path.endswith(suffix):
                p = info.path
                out.append(p[len(root) :] if p.startswith(root) else p.lstrip("/")[len(root.lstrip("/")) :])
        return sorted(out)

    def list_dirs(self, rel: str) -> list[str]:
        infos = self.fs.get_file_info(pafs.FileSelector(self.full(rel), allow_not_found=True))
        return sorted(posixpath.basename(i.path) for i in infos if i.type == pafs.FileType.Directory)

    def has_parquet(self, rel: str) -> bool:
        if self.is_local:
            top = Path(self.full(rel))
            if not top.is_dir():
                return False
            return any(any(f.endswith(".parquet") for f in files) for _dirpath, _dirs, files in os.walk(top))
        return bool(self.list_files(rel, suffix=".parquet"))

    # -- reads and writes ---------------------------------------------------------------------------
    def read_bytes(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self.full(rel)) as f:
            return f.read()

    def makedirs(self, rel: str) -> None:
        self.fs.create_dir(self.full(rel), recursive=True)

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write a small file atomically (temp name, then rename)."""
        parent = posixpath.dirname(rel)
        if parent:
            self.makedirs(parent)
        tmp = f"{rel}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"
        try:
            with self.fs.open_output_stream(self.full(tmp)) as f:
                f.write(data)
        except BaseException:  # a full disk: no temporary file stays behind
            self._discard(tmp)
            raise
        self.move(tmp, rel)

    def _discard(self, rel: str) -> None:
        with contextlib.suppress(OSError):
            self.fs.delete_file(self.full(rel))

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Write a small file only if ``rel`` does not exist; False when it does (nothing written).

        The store decides atomically: a hard link on local disks, ``If-None-Match: *`` on S3. Of two
        writers creating one name, exactly one gets True.
        """
        parent = posixpath.dirname(rel)
        if parent:
            self.makedirs(parent)
        if not self.is_local:
            return objstore.create_exclusive(self.fsspec, self.full(rel), data)
        tmp = self.full(f"{rel}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.link(tmp, self.full(rel))
        except FileExistsError:
            return False
        finally:  # also after a write that failed (a full disk)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return True

    def write_parquet(self, rel: str, table: pa.Table) -> None:
        """Write one Parquet file atomically: readers see all of it or nothing."""
        parent = posixpath.dirname(rel)
        if parent:
            self.makedirs(parent)
        tmp = f"{rel}{TMP_SUFFIX}"
        pq.write_table(table, self.full(tmp), filesystem=self.fs, **parquet_options(table.schema))
        self.move(tmp, rel)

    def open_parquet_writer(self, rel: str, schema: pa.Schema) -> pq.ParquetWriter:
        """A writer on ``rel + TMP_SUFFIX``; call :meth:`move` to publish it once closed."""
        parent = posixpath.dirname(rel)
        if parent:
            self.makedirs(parent)
        return pq.ParquetWriter(self.full(rel + TMP_SUFFIX), schema, filesystem=self.fs, **parquet_options(schema))

    def read_parquet(self, rel: str, columns: list[str] | None = None) -> pa.Table:
        return pq.read_table(self.full(rel), columns=columns, filesystem=self.fs, partitioning=None)

    def move(self, src: str, dst: str) -> None:
        if self.is_local:
            os.replace(self.full(src), self.full(dst))
        else:
            self.fs.move(self.full(src), self.full(dst))

    def delete(self, rel: str) -> None:
        try:
            self.fs.delete_file(self.full(rel))
        except FileNotFoundError:
            pass

    def delete_dir(self, rel: str) -> None:
        try:
            self.fs.delete_dir(self.full(rel))
        except FileNotFoundError:
            pass

    def link(self, src: str, dst: str) -> None:
        """Make ``dst`` a second name of the file ``src`` (a hard link locally; a copy on object stores)."""
        parent = posixpath.dirname(dst)
        if parent:
            self.makedirs(parent)
        if self.is_local:
            os.link(self.full(src), self.full(dst))
        else:
            self.fs.copy_file(self.full(src), self.full(dst))

    def swap_dir(self, staged: str, target: str) -> None:
        """Put directory ``staged`` at ``target``; the old ``target`` (if any) ends at ``staged``.

        Local lakes on Linux exchange the two atomically (renameat2 RENAME_EXCHANGE): a reader sees the old
        partition or the new one, never neither and never a mix. Elsewhere: two renames (a brief gap).
        """
        src, dst = self.full(staged), self.full(target)
        if self.is_local:
            if os.path.exists(dst) and _rename_exchange(src, dst):
                return
            if os.path.exists(dst):
                aside = f"{src}.old"
                os.rename(dst, aside)
                os.rename(src, dst)
                os.rename(aside, src)
                return
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.rename(src, dst)
            os.makedirs(src)
            return
        old = [f for f in self.list_files(target)]
        for rel in self.list_files(staged):
            self.move(rel, posixpath.join(target, posixpath.relpath(rel, staged)))
        for rel in old:
            self.move(rel, posixpath.join(staged, posixpath.relpath(rel, target)))


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _rename_exchange(a: str, b: str) -> bool:
    """Atomically exchange two paths (Linux renameat2); False where unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def table_glob(lake_root: str | os.PathLike[str], table: str) -> str:
    if table in PARTITIONED:
        return f"{lake_root}/{table}/run_id=*/iteration=*/*.parquet"
    return f"{lake_root}/{table}/**/*.parquet"


def connect(
    lake_root: str | os.PathLike[str] | LakeFS,
    *,
    tables: tuple[str, ...] | None = None,
    files: dict[str, list[str]] | None = None,
    partition: tuple[str, int] | None = None,
) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with a view per lake table (sql/views/<table>.sql).

    The lake root is passed to the view definitions as the DuckDB variable ``lake_root``; remote
    (fsspec) lakes get their filesystem registered with DuckDB. Views over tables without files are
    empty and typed. Other files in sql/views (derived views) are created after the table views.

    ``files`` (from :func:`table_files`) pins each table view to those Parquet files instead of a glob
    that DuckDB expands at every query: the connection then needs access to those files and no others.

    ``partition`` = (run_id, iteration) pins the views of the partitioned tables to that one partition's
    files (:func:`partition_files`): a view over the whole lake opens every file of its table when it is
    created (to unite their columns by name), so a per-iteration query would cost what the lake holds;
    pinned, it costs what its iteration holds. Queries still filter by run_id and iteration as they would.
    """
    lake = lake_root if isinstance(lake_root, LakeFS) else LakeFS(lake_root)
    check_format(lake)
    if partition is not None:
        if files is not None:
            raise LakeError("connect takes files or partition, not both")
        files = partition_files(lake, partition[0], partition[1], tables or tuple(TABLES))
    con = duckdb.connect()
    if not lake.is_local:
        con.register_filesystem(lake.fsspec)
    con.execute("set variable lake_root = ?", [lake.url])
    names = tables or tuple(TABLES)
    for name in names:
        con.register(f"_{name}_empty", TABLES[name].empty_table())
        if files is not None and files.get(name):
            _pinned_view(con, name, files[name])
            _conform_view(con, name)
        elif files is None and lake.has_parquet(name):
            con.execute(sqlfiles.sql_text(f"views/{name}"))
            _conform_view(con, name)
        else:
            con.execute(f"create or replace view {name} as select * from _{name}_empty")
    if tables is None:
        for extra in sqlfiles.sql_names("views"):
            if extra not in TABLES:
                con.execute(sqlfiles.sql_text(f"views/{extra}"))
    return con


def _conform_view(con: duckdb.DuckDBPyConnection, name: str) -> None:
    """Make the view over the files read as the schema says (files of every version, one rule).

    Columns of the schema that no file has yet (files written before a column was added) become typed
    NULLs, so every query and audit can name every column of ``schemas``; columns an earlier version wrote
    under another name (:data:`RENAMED`) fill the new ones where those are NULL; columns only files have
    (written by a later version) stay as they are.
    """
    have = {row[0] for row in con.execute(f"select column_name from (describe {name})").fetchall()}
    renamed = {old: news for old, news in RENAMED.get(name, {}).items() if old in have}
    if all(f.name in have for f in TABLES[name]) and not renamed:
        return
    con.execute(f"alter view {name} rename to _{name}_files")
    con.execute(f"create view _{name}_all as select * from _{name}_files union all by name select * from _{name}_empty")
    if not renamed:
        con.execute(f"alter view _{name}_all rename to {name}")
        return
    types = dict(con.execute(f"select column_name, column_type from (describe _{name}_all)").fetchall())
    fills: dict[str, list[str]] = {}
    for news in renamed.values():
        for new, expr in news.items():
            fills.setdefault(new, []).append(f"cast({expr} as {types[new]})")
    replace = ", ".join(f"coalesce({new}, {', '.join(exprs)}) as {new}" for new, exprs in fills.items())
    con.execute(f"create view {name} as select * replace ({replace}) from _{name}_all")


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with ``schema``'s columns, in order and types; columns it lacks (older files) are nulls.

    Pass a schema from :func:`keep_unknown_columns` to keep the columns a later version added."""
    for f in schema:
        if f.name not in table.column_names:
            table = table.append_column(f.name, pa.nulls(table.num_rows, f.type))
    return table.select(schema.names).cast(schema)


def keep_unknown_columns(schema: pa.Schema, written: list[pa.Schema], where: str) -> pa.Schema:
    """``schema`` followed by the columns of the ``written`` file schemas it does not know (written by a later
    clawpipe), so that a rewrite of those files loses none of them; ``where`` names the files in errors."""
    extra: dict[str, pa.Field] = {}
    for file_schema in written:
        for f in file_schema:
            if f.name in schema.names:
                continue
            seen = extra.setdefault(f.name, f.with_nullable(True))
            if not seen.type.equals(f.type):
                raise LakeError(
                    f"column {f.name} of {where} has two types ({seen.type} and {f.type}) in files a later clawpipe "
                    "wrote; this clawpipe cannot rewrite them without losing one: use the version that wrote them"
                )
    return pa.schema(list(schema) + list(extra.values()))


def check_format(lake: LakeFS) -> None:
    """Refuse a lake whose format marker names a later :data:`LAKE_FORMAT` (a lake without one is format 1)."""
    try:
        raw = lake.read_bytes(FORMAT_FILE)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        entry = json.loads(raw)
        fmt = entry["format"]
    except (ValueError, TypeError, KeyError) as exc:
        raise LakeError(
            f"{lake.url}/{FORMAT_FILE} is not a lake format marker ({exc!r}); it should hold "
            f'{{"format": N, "written_by": "clawpipe X"}}: restore it, or remove it if this clawpipe wrote the lake'
        ) from exc
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt > LAKE_FORMAT:
        writer = entry.get("written_by") or "an unknown clawpipe version"
        raise LakeError(
            f"lake {lake.url} is in format {fmt!r}, written by {writer}; this clawpipe ({__version__}) reads and "
            f"writes lake format {LAKE_FORMAT} and earlier: use {writer} or later with this lake"
        )


def mark_format(lake: LakeFS) -> None:
    """Write the format marker of a lake that has none (writers call it, holding the lake's lock)."""
    check_format(lake)
    if not lake.exists(FORMAT_FILE):
        marker = {"format": LAKE_FORMAT, "written_by": f"clawpipe {__version__}"}
        lake.create_exclusive(FORMAT_FILE, json.dumps(marker).encode())


def table_files(lake: LakeFS) -> dict[str, list[str]]:
    """The Parquet files of every table now, as DuckDB names them (what its sql/views glob would match).

    On object stores a compaction under way is applied: its old files while any new one is missing,
    its new files once all are published (never both, never neither).
    """
    while True:
        records, hidden = (frozenset(), set()) if lake.is_local else _compaction_hidden(lake)
        listed = {name: lake.list_files(name, suffix=".parquet") for name in TABLES}
        # a compaction recorded while we listed may have published its files meanwhile: list again
        # (records stay until the next compaction starts, so one that began after `records` is seen here)
        if lake.is_local or _compaction_hidden(lake)[0] == records:
            return {name: [lake.file_url(f) for f in files if f not in hidden] for name, files in listed.items()}


def partition_files(lake: LakeFS, run_id: str, iteration: int, names: tuple[str, ...]) -> dict[str, list[str]]:
    """:func:`table_files` for the tables ``names`` with the partitioned ones restricted to the partition
    (run_id, iteration): what is listed (and later opened) is that partition's files, not the lake's."""
    while True:
        records, hidden = (frozenset(), set()) if lake.is_local else _compaction_hidden(lake)
        listed = {
            name: lake.list_files(
                partition_rel(name, run_id, iteration) if name in PARTITIONED else name, suffix=".parquet"
            )
            for name in names
        }
        if lake.is_local or _compaction_hidden(lake)[0] == records:  # as table_files: a compaction meanwhile
            return {name: [lake.file_url(f) for f in files if f not in hidden] for name, files in listed.items()}


def _compaction_hidden(lake: LakeFS) -> tuple[frozenset[str], set[str]]:
    """(compaction records, the files they hide from readers now)."""
    import orjson

    records = frozenset(
        r
        for r in lake.list_files(posixpath.dirname(COMPACT_PREFIX), suffix=".json", recursive=False)
        if r.startswith(COMPACT_PREFIX)
    )
    hidden: set[str] = set()
    for rec in records:
        try:
            entry = orjson.loads(lake.read_bytes(rec))
        except FileNotFoundError:
            continue  # cleaned up meanwhile: its old files are gone already
        new = entry.get("new", [])
        hidden.update(entry.get("old", []) if all(lake.exists(f) for f in new) else new)
    return records, hidden


def _pinned_view(con: duckdb.DuckDBPyConnection, name: str, files: list[str]) -> None:
    """The table's view over exactly ``files``, with the options its sql/views file gives its glob."""
    con.execute(f"set variable pinned_files_{name} = ?", [files])
    hive = "hive_partitioning = true, hive_types = {'run_id': 'VARCHAR', 'iteration': 'INTEGER'}, "
    con.execute(
        f"create or replace view {name} as select * from read_parquet("
        f"getvariable('pinned_files_{name}'), {hive if name in PARTITIONED else ''}union_by_name = true)"
    )


def partition_dir(lake_root: str | os.PathLike[str], table: str, run_id: str, iteration: int) -> Path:
    return Path(lake_root) / partition_rel(table, run_id, iteration)


def partition_rel(table: str, run_id: str, iteration: int) -> str:
    return f"{table}/run_id={run_id}/iteration={int(iteration)}"


def replace_partition(
    lake_root: str | os.PathLike[str] | LakeFS, table: str, run_id: str, iteration: int, data: pa.Table
) -> Path:
    """Atomically replace one (run_id, iteration) partition of a table with ``data``.

    The new file is written to ``<lake>/_staging/<id>/`` and swapped in (see :meth:`LakeFS.swap_dir`):
    on local lakes a reader sees the old partition or the new one, never a mix. Idempotent rewrite.
    """
    if table not in TABLES:
        raise LakeError(f"unknown table {table!r}; known: {sorted(TABLES)}")
    schema = TABLES[table]
    try:
        data = conform(data, schema)
    except (KeyError, pa.ArrowInvalid) as exc:
        raise LakeError(f"rows for {table} do not match schemas.{table.upper()}: {exc}") from exc
    lake = lake_root if isinstance(lake_root, LakeFS) else LakeFS(lake_root)
    check_format(lake)
    staged = f"{STAGING}/{uuid.uuid4().hex}"
    target = partition_rel(table, run_id, iteration)
    try:
        lake.write_parquet(f"{staged}/part-{uuid.uuid4().hex}.parquet", data)
        lake.swap_dir(staged, target)
    except BaseException:  # a write that fails (a full disk) leaves no staging folder; the old partition stays
        with contextlib.suppress(OSError):
            lake.delete_dir(staged)
        raise
    lake.delete_dir(staged)
    return Path(lake.full(target))
