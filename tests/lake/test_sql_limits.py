"""Limits of ad hoc and saved SQL over a real lake: a wall-clock limit that interrupts the query, memory and
spill caps with spilling outside the lake, and the CLI's options for them."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from clawpipe import schemas, sqlfiles, tables
from clawpipe.cli import app
from clawpipe.errors import ConfigError, LakeError
from clawpipe.lake import query, run_saved, run_sql

N_CALLS = 10_000  # a three-way cross join of these is 10^12 rows: minutes of work on any CPU
CROSS = "select count(*) from model_calls a, model_calls b, model_calls c"
# a sort of 2M md5 strings (~100 MB): more than a 48 MB memory cap holds
SORT = "select count(*) as n from (select md5(i::varchar) as s from range(2000000) t(i) order by s)"
SANITY_S = 30.0  # an upper bound on a 1 s limit's wall time, only against hanging: never a timing claim
# a query the limit failed to stop runs for minutes inside DuckDB, where no signal reaches: fail the test from a thread
HANG = pytest.mark.timeout(120, method="thread")


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("limits") / "lake"
    rows = [
        {"call_id": f"c{i}", "choice_index": 0, "run_id": "A", "iteration": 0, "rollout_id": f"r{i % 50}"}
        for i in range(N_CALLS)
    ]
    tables.replace_partition(
        root, "model_calls", "A", 0, pa.Table.from_pylist(rows, schema=schemas.TABLES["model_calls"])
    )
    return root


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The system's temporary folder for this test (what TMPDIR names): where a query may spill."""
    folder = tmp_path / "scratch"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working folder: DuckDB's own default spill place is ./.tmp."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


@pytest.fixture
def sql_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A copy of sql/ that a test may add saved queries to (the loader's cache cleared around it)."""
    copy = tmp_path / "sql"
    shutil.copytree(sqlfiles.SQL_DIR, copy)
    monkeypatch.setattr(sqlfiles, "SQL_DIR", copy)
    sqlfiles.sql_text.cache_clear()
    yield copy
    sqlfiles.sql_text.cache_clear()


def _lake_bytes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def _calls(lake: Path, **limits: Any) -> int:
    value = run_sql(lake, "select count(*) from model_calls", **limits).column(0)[0].as_py()
    assert isinstance(value, int)
    return value


def _one_line(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


@HANG
def test_a_cross_join_past_its_time_limit_is_interrupted_naming_the_limit(lake: Path, scratch: Path) -> None:
    before = _lake_bytes(lake)
    started = time.monotonic()
    with pytest.raises(LakeError, match=r"ran past its time limit of 1 s .*--timeout-s N.*timeout_s=N") as info:
        run_sql(lake, CROSS, timeout_s=1, threads=1)
    assert time.monotonic() - started < SANITY_S
    assert isinstance(info.value.__cause__, duckdb.InterruptException)  # DuckDB stopped it; it did not finish
    assert _lake_bytes(lake) == before
    assert list(scratch.iterdir()) == []  # the query's spill folder went with it
    assert _calls(lake, timeout_s=30) == N_CALLS


@HANG
@pytest.mark.parametrize("limit", [0.001, 0.05])
def test_a_limit_that_passes_before_the_query_starts_still_stops_it(lake: Path, limit: float) -> None:
    """DuckDB forgets an interrupt that comes before its query starts: the watchdog keeps interrupting."""
    started = time.monotonic()
    with pytest.raises(LakeError, match=f"time limit of {limit:g} s"):
        run_sql(lake, CROSS, timeout_s=limit, threads=1)
    assert time.monotonic() - started < SANITY_S


@HANG
def test_the_default_time_limit_applies_when_none_is_given(lake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(query, "DEFAULT_TIMEOUT_S", 1.0)
    with pytest.raises(LakeError, match="time limit of 1 s"):
        run_sql(lake, CROSS, threads=1)


def test_queries_that_finish_in_time_return_their_rows(lake: Path) -> None:
    assert _calls(lake, timeout_s=60) == N_CALLS
    assert _calls(lake, timeout_s=0) == N_CALLS  # 0: no limit
    assert _calls(lake, timeout_s=60, memory_mb=256, spill_mb=0, threads=1) == N_CALLS
    rows = run_saved(lake, "calls_tokens_per_rollout", {"run_id": "A"}, timeout_s=60, threads=1)
    assert rows.num_rows == 50 and sum(rows.column("calls").to_pylist()) == N_CALLS


@HANG
def test_a_saved_query_is_stopped_at_its_limit(lake: Path, sql_dir: Path) -> None:
    (sql_dir / "analytics" / "every_triple.sql").write_text(f"-- every triple of calls\n{CROSS}\n")
    with pytest.raises(LakeError, match="time limit of 1 s"):
        run_saved(lake, "every_triple", timeout_s=1, threads=1)
    res = CliRunner().invoke(
        app, ["sql", "--saved", "every_triple", "--lake", str(lake), "--timeout-s", "1", "--threads", "1"]
    )
    assert res.exit_code == 1
    assert res.stderr.startswith("error: the query ran past its time limit of 1 s")


@HANG
@pytest.mark.slow
def test_no_watchdog_thread_outlives_its_call(lake: Path) -> None:
    start = threading.active_count()
    for _ in range(200):
        assert run_sql(lake, "select 1 as one", timeout_s=60).column(0).to_pylist() == [1]
    for _ in range(3):
        with pytest.raises(LakeError, match="time limit"):
            run_sql(lake, CROSS, timeout_s=0.2, threads=1)
    assert threading.active_count() == start
    assert not [t for t in threading.enumerate() if t.name == "clawpipe-sql-watchdog"]


def test_a_query_over_its_memory_cap_gets_an_error_naming_the_cap(lake: Path, scratch: Path, cwd: Path) -> None:
    with pytest.raises(LakeError, match=r"memory cap of 48 MB with spilling off .*--memory-mb N") as info:
        run_sql(lake, SORT, memory_mb=48, spill_mb=0, threads=1)
    assert isinstance(info.value.__cause__, duckdb.OutOfMemoryException)
    with pytest.raises(LakeError, match=r"spilled more than its spill cap of 1 MB .*--spill-mb N"):
        run_sql(lake, SORT, memory_mb=48, spill_mb=1, threads=1)
    assert list(scratch.iterdir()) == [] and list(cwd.iterdir()) == []  # nothing left behind anywhere
    assert _calls(lake) == N_CALLS  # the process goes on


def test_a_query_larger_than_its_memory_cap_spills_outside_the_lake(lake: Path, scratch: Path, cwd: Path) -> None:
    """The sort that fails under 48 MB without spilling finishes when it may spill: into a private folder under
    TMPDIR, removed when it ends; the lake stays byte-identical."""
    before = _lake_bytes(lake)
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:  # the size of what lies under TMPDIR, while the query runs
        while not done.wait(0.01):
            seen.add(sum(p.stat().st_size for p in scratch.rglob("*") if p.is_file()))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        rows = run_sql(lake, SORT, memory_mb=48, spill_mb=1000, threads=1).to_pylist()
    finally:
        done.set()
        watcher.join()
    assert rows == [{"n": 2_000_000}]
    assert max(seen) > 0  # it did spill, and under TMPDIR
    assert list(scratch.iterdir()) == [] and list(cwd.iterdir()) == []
    assert _lake_bytes(lake) == before


def test_a_temporary_folder_inside_the_lake_is_refused(lake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = _lake_bytes(lake)
    monkeypatch.setattr(tempfile, "tempdir", str(lake / "model_calls"))
    with pytest.raises(LakeError, match=r"temporary folder .* \(TMPDIR\) lies inside the lake.*--spill-mb 0"):
        _calls(lake)
    assert _calls(lake, spill_mb=0) == N_CALLS  # no spilling: nothing to put there
    assert _lake_bytes(lake) == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timeout_s": -1}, r"timeout_s=-1 is not a number of seconds >= 0.*--timeout-s 600"),
        ({"timeout_s": float("nan")}, r"timeout_s=nan is not a number of seconds"),
        ({"timeout_s": float("inf")}, r"timeout_s=inf is not a number of seconds.*0 for no limit"),
        ({"timeout_s": "10"}, r"timeout_s='10' is not a number of seconds"),
        ({"timeout_s": True}, r"timeout_s=True is not a number of seconds"),
        ({"memory_mb": 0}, r"memory_mb=0 is not a whole number >= 1.*--memory-mb"),
        ({"memory_mb": 1.5}, r"memory_mb=1.5 is not a whole number"),
        ({"spill_mb": -1}, r"spill_mb=-1 is not a whole number >= 0.*--spill-mb"),
        ({"threads": 0}, r"threads=0 is not a whole number >= 1.*--threads"),
    ],
)
def test_bad_limit_values_are_refused_naming_them(lake: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        run_sql(lake, "select 1", **kwargs)
    with pytest.raises(ConfigError, match=message):
        run_saved(lake, "failure_reasons", **kwargs)


@HANG
def test_cli_prints_one_line_and_exits_1_when_a_limit_stops_the_query(lake: Path, cwd: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["sql", CROSS, "--lake", str(lake), "--timeout-s", "1", "--threads", "1"])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit)
    assert res.stdout == ""
    (line,) = res.stderr.splitlines()
    assert line.startswith("error: the query ran past its time limit of 1 s") and "--timeout-s" in line
    res = runner.invoke(app, ["sql", SORT, "--lake", str(lake), "--memory-mb", "48", "--spill-mb", "0"])
    assert res.exit_code == 1
    (line,) = res.stderr.splitlines()
    assert "memory cap of 48 MB" in line and "--memory-mb" in line
    fine = runner.invoke(
        app, ["sql", "select count(*) as n from model_calls", "--lake", str(lake), "--timeout-s", "60"]
    )
    assert fine.exit_code == 0 and f"{N_CALLS}" in fine.stdout


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--timeout-s", "-1"),
        ("--timeout-s", "nan"),
        ("--timeout-s", "inf"),
        ("--timeout-s", "soon"),
        ("--memory-mb", "0"),
        ("--memory-mb", "1.5"),
        ("--spill-mb", "-1"),
        ("--threads", "0"),
    ],
)
def test_cli_refuses_bad_limit_options_naming_them(lake: Path, option: str, value: str) -> None:
    res = CliRunner().invoke(app, ["sql", "select 1", "--lake", str(lake), option, value])
    assert res.exit_code == 2
    assert f"Invalid value for '{option}'" in _one_line(res.output)


def test_the_defaults_fit_a_shared_machine() -> None:
    limits = query.QueryLimits.resolve()
    assert limits.timeout_s == query.DEFAULT_TIMEOUT_S
    import psutil

    assert limits.memory_mb <= psutil.virtual_memory().total // 1_000_000 // 4 + 64
    cpus = len(os.sched_getaffinity(0))
    assert 1 <= limits.threads <= max(1, cpus // 2)
    assert 0 < limits.spill_mb <= shutil.disk_usage(tempfile.gettempdir()).total // 1_000_000 // 4
