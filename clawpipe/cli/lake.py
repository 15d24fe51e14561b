"""``clawpipe land``, ``clawpipe sql`` and ``clawpipe lake check|compact|saved``: the trajectory lake."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import typer

FORMATS = ("table", "csv", "json", "parquet")


def _lake_root(lake: str | None) -> str:
    from clawpipe.config import get_settings

    return lake or get_settings().lake_dir


def _fail(exc: Exception) -> None:
    typer.secho(f"error: {shown_text(str(exc), keep_newlines=True)}", err=True, fg="red")
    raise typer.Exit(1)


# Characters a terminal acts on rather than shows: C0 controls (escape sequences, carriage return, bell), DEL,
# C1 controls, and the bidirectional overrides that make text read other than it is stored.
_UNSHOWN = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def shown_text(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` safe to print to a terminal: what the lake holds comes from harnesses and the policy, and an
    escape sequence in a model's answer or a harness's stderr must not drive the reader's terminal. Control
    characters are written as escapes (``\\n``, ``\\x1b``, ``\\u202e``)."""

    def esc(m: re.Match[str]) -> str:
        c = m.group()
        if c == "\n":
            return "\n" if keep_newlines else "\\n"
        if c == "\t":
            return "\\t"
        return f"\\x{ord(c):02x}" if ord(c) <= 0xFF else f"\\u{ord(c):04x}"

    return _UNSHOWN.sub(esc, text)


def _check_timeout(value: float | None) -> float | None:
    """--timeout-s: seconds >= 0 (click's float takes 'nan' and 'inf', which are no limit one could mean)."""
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise typer.BadParameter(
            f"{value} is not a number of seconds >= 0; give e.g. --timeout-s 600, or 0 for no limit"
        )
    return value


def _cell(v: Any, width: int = 60) -> str:
    s = "NULL" if v is None else v if isinstance(v, str) else json.dumps(v, default=str)
    s = shown_text(s)
    return s if len(s) <= width else s[: width - 1] + "…"


def _print_table(table: Any) -> None:
    names = [shown_text(n) for n in table.column_names]  # PIVOT makes column names of values
    rows = [[_cell(v) for v in row.values()] for row in table.to_pylist()]
    widths = [max([len(n)] + [len(r[i]) for r in rows]) for i, n in enumerate(names)]
    out = sys.stdout
    out.write(" | ".join(n.ljust(w) for n, w in zip(names, widths, strict=True)) + "\n")
    out.write("-+-".join("-" * w for w in widths) + "\n")
    for r in rows:
        out.write(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + "\n")
    out.write(f"({table.num_rows} row{'s' if table.num_rows != 1 else ''})\n")


def _flatten_nested(table: Any) -> Any:
    """CSV cannot hold lists or structs: nested columns become JSON text."""
    import pyarrow as pa

    cols = []
    for col in table.columns:
        if pa.types.is_nested(col.type):
            cols.append(pa.array([None if v is None else json.dumps(v, default=str) for v in col.to_pylist()]))
        else:
            cols.append(col)
    return pa.table(cols, names=table.column_names)


def _check_lake(lake: str | None) -> None:
    """A local lake folder must exist: a mistyped lake would otherwise answer every query with no rows.
    ``lake``: the ``--lake`` given, or None for the home's lake (the message then names where it comes from)."""
    from clawpipe.errors import ConfigError
    from clawpipe.tables import LakeFS

    fs = LakeFS(_lake_root(lake))
    if not fs.is_local or Path(fs.root).is_dir():
        return
    what = "a file, not a folder" if Path(fs.root).exists() else "no such folder"
    if lake is not None:
        raise typer.BadParameter(
            f"--lake {lake}: no lake there ({fs.root}: {what}); land captures first (clawpipe land) "
            "or give the lake's folder"
        )
    raise ConfigError(
        f"no lake at {fs.root} ({what}), the lake of this home (CLAWPIPE_LAKE_URI, else CLAWPIPE_HOME's lake/): "
        "land captures first (clawpipe land), or give --lake FOLDER"
    )


def _check_out(out: Path, lake_root: str) -> None:
    """``--out`` must be a file this command may write: not a folder, in an existing one, outside the lake
    (a result written among the lake's files would become part of a table and its rows counted twice)."""
    from clawpipe.tables import LakeFS

    target = out.expanduser().resolve()
    if target.is_dir():
        raise typer.BadParameter(f"--out {out} is a folder; give a file path")
    if not target.parent.is_dir():
        raise typer.BadParameter(f"--out {out}: folder {target.parent} does not exist; create it or write elsewhere")
    lake = LakeFS(lake_root)
    if lake.is_local and target.is_relative_to(lake.root):
        raise typer.BadParameter(
            f"--out {out} is inside the lake ({lake.root}), which clawpipe sql leaves read-only; write elsewhere"
        )


def _read_stdin_query() -> str:
    """QUERY ``-``: the statement from stdin, so a query kept in a file runs as it is, comments and all (given
    as an argument, one starting with a ``--`` comment would be read as an option)."""
    if sys.stdin.isatty():
        raise typer.BadParameter("QUERY - reads the statement from stdin: pipe it in (clawpipe sql - < query.sql)")
    text = sys.stdin.read()
    if not text.strip():
        raise typer.BadParameter("QUERY - read no statement from stdin; pipe one in (clawpipe sql - < query.sql)")
    return text


def _reader_gone() -> None:
    """stdout's reader closed the pipe (``clawpipe sql ... | head``): what it wanted was shown, so stop quietly.
    stdout is pointed at /dev/null so the interpreter's last flush does not raise again (Python's documented
    handling of SIGPIPE), and the exit status is 1, as for a write that did not complete."""
    import contextlib
    import os

    with contextlib.suppress(OSError, ValueError):  # a stdout without a file descriptor has nothing to flush
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    raise typer.Exit(1)


def _emit(table: Any, fmt: str, out: Path | None) -> None:
    try:
        _write(table, fmt, out)
    except OverflowError:  # a value Python has no type for (an infinite date), met while rendering the rows
        _fail(ValueError(_unshowable(table, fmt)))
    except OSError as exc:
        if out is None and isinstance(exc, BrokenPipeError):
            _reader_gone()
        _fail(OSError(f"cannot write --out {out}: {exc}; give a writable file path"))


def _unshowable(table: Any, fmt: str) -> str:
    """What to do when the rows hold a value Python cannot represent (DuckDB's infinite dates and timestamps)."""
    bad = []
    for name, col in zip(table.column_names, table.columns, strict=True):
        try:
            col.to_pylist()
        except OverflowError:
            bad.append(name)
    first = bad[0] if bad else "the column"
    return (
        f"column(s) {', '.join(bad) or '?'} hold a value --format {fmt} cannot show (an infinite or out-of-range "
        f"date or timestamp); cast it in the query ({first}::varchar) or use --format csv or parquet"
    )


def _write(table: Any, fmt: str, out: Path | None) -> None:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        if out is None:
            raise typer.BadParameter("--format parquet needs --out FILE")
        pq.write_table(table, out)
        typer.echo(f"wrote {table.num_rows} rows to {out}", err=True)
        return
    if fmt == "csv":
        import io

        import pyarrow.csv as pcsv

        buf = io.BytesIO()
        pcsv.write_csv(_flatten_nested(table), buf)
        data = buf.getvalue()
    elif fmt == "json":
        lines = [json.dumps(row, default=str) for row in table.to_pylist()]
        data = ("\n".join(lines) + ("\n" if lines else "")).encode()
    else:
        if out is None:
            _print_table(table)
            return
        import contextlib
        import io

        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            _print_table(table)
        data = text.getvalue().encode()
    if out is None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        out.write_bytes(data)


def register(app: typer.Typer) -> None:
    lake_app = typer.Typer(help="Trajectory lake upkeep: audits, compaction, saved queries.", no_args_is_help=True)
    app.add_typer(lake_app, name="lake")

    @app.command("land")
    def land_cmd(
        captures: str | None = typer.Option(
            None, "--captures", help="Capture dir or URL (e.g. s3://bucket/lake/captures); default <home>/captures."
        ),
        lake: str | None = typer.Option(None, "--lake", help="Lake root (path or URL); default <CLAWPIPE_HOME>/lake."),
    ) -> None:
        """Land new capture segments and rollout results into the lake (exactly once; safe to rerun)."""
        from clawpipe.config import get_settings
        from clawpipe.errors import ClawpipeError
        from clawpipe.lake import land

        try:
            report = land(captures or get_settings().captures_dir, _lake_root(lake))
        except ClawpipeError as exc:
            _fail(exc)
        typer.echo(
            f"landed {report.calls} calls ({report.rows} rows), {report.rollouts} rollout rows, "
            f"{report.rejects} rejects, {report.duplicates} duplicates skipped, from {report.segments} segments "
            f"in {report.seconds:.2f}s"
        )
        notes = []
        if report.damaged_bytes:
            notes.append(f"{report.damaged_bytes} capture bytes in damaged regions (each one reject)")
        if report.stream_errors:
            notes.append(f"{report.stream_errors} 200 answers that ended in an error, landed as upstream_error")
        if report.policy_version_mismatches:
            notes.append(
                f"{report.policy_version_mismatches} calls where the engine's policy_version is not the proxy's stamp"
            )
        if notes:
            typer.echo("; ".join(notes) + " (see `clawpipe sql` on rejects and `clawpipe lake check`)")

    @app.command("sql")
    def sql_cmd(
        query: str | None = typer.Argument(
            None, help="One read-only SQL statement over the lake's views; - reads it from stdin (a .sql file)."
        ),
        saved: str | None = typer.Option(None, "--saved", help="Run sql/analytics/NAME.sql instead."),
        param: list[str] = typer.Option([], "--param", help="k=v for a saved query's $k (repeat)."),
        fmt: str = typer.Option("table", "--format", help="table | csv | json (JSON lines) | parquet."),
        out: Path | None = typer.Option(None, "--out", help="Write to this file instead of stdout."),
        lake: str | None = typer.Option(None, "--lake", help="Lake root (path or URL); default <CLAWPIPE_HOME>/lake."),
        timeout_s: float | None = typer.Option(
            None,
            "--timeout-s",
            callback=_check_timeout,
            help="Stop the query after this many seconds; default 300, 0: none.",
        ),
        memory_mb: int | None = typer.Option(
            None, "--memory-mb", min=1, help="Memory the query may use, in MB; default a quarter of physical memory."
        ),
        spill_mb: int | None = typer.Option(
            None,
            "--spill-mb",
            min=0,
            help="Data the query may spill under TMPDIR, in MB; default a quarter of the free space there, 0: none.",
        ),
        threads: int | None = typer.Option(
            None, "--threads", min=1, help="Threads for the query; default half the CPUs."
        ),
    ) -> None:
        """Ad hoc, read-only SQL over model_calls, rollouts, tree_nodes, tree_stats, tree_sequences and rejects."""
        from clawpipe.errors import ClawpipeError
        from clawpipe.lake import run_saved, run_sql

        if fmt not in FORMATS:
            raise typer.BadParameter(f"--format must be one of {', '.join(FORMATS)}")
        if (query is None) == (saved is None):
            raise typer.BadParameter("give a QUERY or --saved NAME (one of them)")
        if fmt == "parquet" and out is None:
            raise typer.BadParameter("--format parquet needs --out FILE")
        _check_lake(lake)
        if out is not None:
            _check_out(out, _lake_root(lake))
        if query == "-":
            query = _read_stdin_query()
        params: dict[str, str] = {}
        for p in param:
            if "=" not in p:
                raise typer.BadParameter(f"--param {p!r}: expected k=v")
            k, v = p.split("=", 1)
            k = k.strip().lstrip("$")
            if k in params:
                raise typer.BadParameter(f"--param {k} is given twice ({params[k]!r} and {v!r}); give it once")
            params[k] = v
        limits: dict[str, Any] = {
            "timeout_s": timeout_s,
            "memory_mb": memory_mb,
            "spill_mb": spill_mb,
            "threads": threads,
        }
        try:
            if saved is not None:
                table = run_saved(_lake_root(lake), saved, params, **limits)
            else:
                if params:
                    raise typer.BadParameter("--param goes with --saved")
                table = run_sql(_lake_root(lake), query or "", **limits)
        except ClawpipeError as exc:
            _fail(exc)
        _emit(table, fmt, out)

    @lake_app.command("check")
    def check_cmd(
        lake: str | None = typer.Option(None, "--lake", help="Lake root (path or URL); default <CLAWPIPE_HOME>/lake."),
        show: int = typer.Option(10, "--show", min=0, help="Offending rows to print per failed audit."),
        timeout_s: float | None = typer.Option(
            None, "--timeout-s", callback=_check_timeout, help="Stop an audit after this many seconds; default none."
        ),
        memory_mb: int | None = typer.Option(
            None, "--memory-mb", min=1, help="Memory an audit may use, in MB; default a quarter of physical memory."
        ),
    ) -> None:
        """Run every audit in sql/audits; exit 1 when any returns offending rows."""
        from clawpipe.errors import ClawpipeError
        from clawpipe.lake import run_audits

        if lake is not None:  # a mistyped --lake would pass every audit on no data
            _check_lake(lake)
        try:
            results = run_audits(_lake_root(lake), timeout_s=timeout_s or 0, memory_mb=memory_mb)
        except ClawpipeError as exc:
            _fail(exc)
        failed = 0
        for name, table in results.items():
            if table.num_rows == 0:
                typer.echo(f"PASS {name}")
                continue
            failed += 1
            typer.secho(f"FAIL {name}: {table.num_rows} offending rows", fg="red")
            _print_table(table.slice(0, show))
        typer.echo(f"{len(results) - failed}/{len(results)} audits passed")
        if failed:
            raise typer.Exit(1)

    @lake_app.command("compact")
    def compact_cmd(
        lake: str | None = typer.Option(None, "--lake", help="Lake root (path or URL); default <CLAWPIPE_HOME>/lake."),
        min_files: int = typer.Option(
            2, "--min-files", min=1, help="Compact partitions holding at least this many parts."
        ),
    ) -> None:
        """Merge each partition's part files into one (atomic per partition; readers never wait)."""
        from clawpipe.errors import ClawpipeError
        from clawpipe.lake import compact

        if lake is not None:  # a mistyped --lake would be created empty and "compacted"
            _check_lake(lake)
        try:
            r = compact(_lake_root(lake), min_files=min_files)
        except ClawpipeError as exc:
            _fail(exc)
        typer.echo(
            f"compacted {r.partitions} partitions: {r.files_before} -> {r.files_after} files, {r.rows} rows, "
            f"{r.duplicates_dropped} duplicates dropped, in {r.seconds:.2f}s"
        )

    @lake_app.command("saved")
    def saved_cmd() -> None:
        """List the saved queries (sql/analytics) and their parameters."""
        from clawpipe import sqlfiles
        from clawpipe.errors import LakeError
        from clawpipe.lake.query import query_params, saved_names

        broken = 0
        for name in saved_names():
            try:  # one file that does not parse is named, and the others are still listed
                text = sqlfiles.sql_text(f"analytics/{name}")
                params = ", ".join(f"${p}" for p in query_params(text)) or "-"
            except LakeError as exc:
                broken += 1
                typer.secho(f"{name}  [cannot read: {str(exc).splitlines()[0]}]", err=True, fg="red")
                continue
            first = next((ln[2:].strip() for ln in text.splitlines() if ln.startswith("--")), "")
            typer.echo(f"{name}  [{params}]  {first}")
        if broken:
            raise typer.Exit(1)
