"""Saved queries' ``$name`` parameters as users give them: each takes the type of the lake column it is named
after, so a run id that reads as a number still filters, and a value of the wrong kind is an error naming the
parameter, the value and a value that works; missing ones are NULL (no filter), extra ones are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from clawpipe import schemas, tables
from clawpipe.cli import app
from clawpipe.errors import LakeError
from clawpipe.lake import run_saved
from clawpipe.lake.query import typed_param

RUNS = ("A", "42", "1e3", "007")


def _rollout(run: str, it: int) -> dict[str, Any]:
    return {
        "rollout_id": f"r-{run}-{it}",
        "run_id": run,
        "iteration": it,
        "harness": "h1",
        "status": "failed",
        "error": f"boom {run}",
        "eval": False,
        "reward": 0.5,
    }


def _call(run: str, it: int) -> dict[str, Any]:
    return {
        "call_id": f"c-{run}-{it}",
        "choice_index": 0,
        "run_id": run,
        "iteration": it,
        "rollout_id": f"r-{run}-{it}",
        "api": "chat",
        "status": "ok",
        "policy_version": 1,
        "prompt_tokens": 3,
        "completion_tokens": 2,
    }


@pytest.fixture
def lake(tmp_path: Path) -> Path:
    root = tmp_path / "lake"
    for run in RUNS:
        for it in (0, 1):
            for table, row in (("rollouts", _rollout(run, it)), ("model_calls", _call(run, it))):
                batch = pa.Table.from_pylist([row], schema=schemas.TABLES[table])
                tables.replace_partition(root, table, run, it, batch)
    return root


@pytest.mark.parametrize("run", ["42", "1e3", "007", "A"])
def test_a_run_id_that_reads_as_a_number_filters_as_text(lake: Path, run: str) -> None:
    for name in ("reward_by_harness_iteration", "failure_reasons", "calls_tokens_per_rollout"):
        rows = run_saved(lake, name, {"run_id": run}).to_pylist()
        assert rows and {r["run_id"] for r in rows} == {run}, (name, rows)


def test_an_integer_parameter_filters_and_a_bad_one_names_the_fix(lake: Path) -> None:
    rows = run_saved(lake, "calls_tokens_per_rollout", {"run_id": "42", "iteration": "1"}).to_pylist()
    assert [r["rollout_id"] for r in rows] == ["r-42-1"]
    for bad in ("abc", "1.5", "nan", "1e3", "", "true"):
        with pytest.raises(LakeError) as info:
            run_saved(lake, "calls_tokens_per_rollout", {"iteration": bad})
        message = str(info.value)
        assert f"iteration={bad!r} is not a whole number" in message, message
        assert "calls_tokens_per_rollout" in message and "--param iteration=3" in message


def test_missing_parameters_are_no_filter_and_null_is_the_same(lake: Path) -> None:
    every = run_saved(lake, "calls_tokens_per_rollout").num_rows
    assert every == len(RUNS) * 2
    assert run_saved(lake, "calls_tokens_per_rollout", {"run_id": "null", "iteration": "NULL"}).num_rows == every
    assert run_saved(lake, "calls_tokens_per_rollout", {"iteration": "0"}).num_rows == len(RUNS)


def test_an_extra_parameter_names_the_ones_taken(lake: Path) -> None:
    with pytest.raises(LakeError) as info:
        run_saved(lake, "failure_reasons", {"run_id": "A", "iteration": "0"})
    message = str(info.value)
    assert "failure_reasons takes run_id; unknown: ['iteration']" in message and "clawpipe lake saved" in message


def test_parameters_of_other_column_types() -> None:
    assert typed_param("q", "reward", "0.25") == 0.25
    assert typed_param("q", "eval", "TRUE") is True and typed_param("q", "eval", "false") is False
    assert typed_param("q", "harness", 5) == "5"  # a text column gets text, whatever it was given as
    assert typed_param("q", "not_a_column", "7") == 7  # no column of that name: guessed from the text
    with pytest.raises(LakeError, match=r"reward='inf' is not a finite number .*reward=0\.5"):
        typed_param("q", "reward", "inf")
    with pytest.raises(LakeError, match=r"eval='yes' is not true or false .*eval=true"):
        typed_param("q", "eval", "yes")


def test_cli_refuses_a_parameter_given_twice(lake: Path) -> None:
    res = CliRunner().invoke(
        app,
        ["sql", "--saved", "failure_reasons", "--param", "run_id=A", "--param", "run_id=42", "--lake", str(lake)],
    )
    assert res.exit_code == 2
    assert "given twice" in " ".join(res.output.replace("│", " ").split())


@pytest.fixture
def sql_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of sql/ that tests may add saved queries to (the loader's cache cleared around it)."""
    import shutil

    from clawpipe import sqlfiles

    copy = tmp_path / "sql"
    shutil.copytree(sqlfiles.SQL_DIR, copy)
    monkeypatch.setattr(sqlfiles, "SQL_DIR", copy)
    sqlfiles.sql_text.cache_clear()
    yield copy
    sqlfiles.sql_text.cache_clear()


def test_parameters_are_the_ones_duckdb_parses(lake: Path, sql_dir: Path) -> None:
    """A $name in a block comment or a quoted column name is no parameter: giving it a value failed the query."""
    from clawpipe.lake.query import query_params

    (sql_dir / "analytics" / "commented.sql").write_text(
        "-- rollouts of a run ($not_this)\n/* was: a $harness filter */\n"
        "select count(*) as n, '$nor_this' as s, 1 as \"$col\"\n"
        "from rollouts where $run_id is null or run_id = $run_id\n"
    )
    assert query_params((sql_dir / "analytics" / "commented.sql").read_text()) == ["run_id"]
    assert run_saved(lake, "commented").to_pylist() == [{"n": len(RUNS) * 2, "s": "$nor_this", "$col": 1}]
    assert run_saved(lake, "commented", {"run_id": "42"}).column("n").to_pylist() == [2]
    listing = CliRunner().invoke(app, ["lake", "saved"])
    assert "commented  [$run_id]  rollouts of a run" in listing.output


def test_a_saved_query_that_does_not_parse_is_named_and_the_others_still_listed(lake: Path, sql_dir: Path) -> None:
    (sql_dir / "analytics" / "aaa_broken.sql").write_text("-- half written\nselect count(* from rollouts\n")
    listing = CliRunner().invoke(app, ["lake", "saved"])
    assert listing.exit_code == 1
    assert "aaa_broken  [cannot read: Parser Error" in listing.output
    assert "calls_tokens_per_rollout  [$iteration, $run_id]" in listing.output  # listed after the broken one
    with pytest.raises(LakeError, match="Parser Error"):
        run_saved(lake, "aaa_broken")
