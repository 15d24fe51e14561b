"""``clawpipe sql --out``: the result goes to a file the user names, never among the lake's files, and a path
that cannot be written is a one-line error before the query runs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from clawpipe import schemas, tables
from clawpipe.cli import app


@pytest.fixture
def lake(tmp_path: Path) -> Path:
    root = tmp_path / "lake"
    row = {"rollout_id": "r1", "run_id": "A", "iteration": 0, "harness": "h1", "status": "succeeded", "eval": False}
    tables.replace_partition(root, "rollouts", "A", 0, pa.Table.from_pylist([row], schema=schemas.TABLES["rollouts"]))
    return root


def _lake_bytes(root: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


def _sql(lake: Path, *args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, ["sql", "select * from rollouts", "--lake", str(lake), *args])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception  # no traceback
    return res.exit_code, " ".join(res.output.replace("│", " ").split())  # the usage box wraps long lines


def test_out_inside_the_lake_is_refused_and_the_lake_is_unchanged(lake: Path) -> None:
    before = _lake_bytes(lake)
    part_dir = next((lake / "rollouts").rglob("*.parquet")).parent
    for target in (part_dir / "copy.parquet", lake / "dump.csv", lake / "rollouts" / ".." / "x.json"):
        fmt = {".parquet": "parquet", ".csv": "csv", ".json": "json"}[target.suffix]
        code, output = _sql(lake, "--format", fmt, "--out", str(target))
        assert code == 2 and "inside the lake" in output and "write elsewhere" in output, output
    assert _lake_bytes(lake) == before
    assert tables.connect(lake).sql("select count(*) from rollouts").fetchall() == [(1,)]  # no doubled rows


def test_out_through_a_link_into_the_lake_is_refused(lake: Path, tmp_path: Path) -> None:
    link = tmp_path / "looks-outside"
    link.symlink_to(lake / "rollouts")
    before = _lake_bytes(lake)
    code, output = _sql(lake, "--format", "parquet", "--out", str(link / "x.parquet"))
    assert code == 2 and "inside the lake" in output
    assert _lake_bytes(lake) == before


def test_out_that_cannot_be_written_is_a_clear_error(lake: Path, tmp_path: Path) -> None:
    code, output = _sql(lake, "--format", "csv", "--out", str(tmp_path / "no" / "such" / "dir" / "x.csv"))
    assert code == 2 and "does not exist" in output and "create it" in output
    code, output = _sql(lake, "--format", "csv", "--out", str(tmp_path))
    assert code == 2 and "is a folder" in output
    code, output = _sql(lake, "--format", "csv", "--out", "/proc/version")  # exists, but no one may write it
    assert code == 1 and "cannot write --out /proc/version" in output and "writable file path" in output


def test_out_outside_the_lake_still_writes(lake: Path, tmp_path: Path) -> None:
    out = tmp_path / "res.json"
    code, output = _sql(lake, "--format", "json", "--out", str(out))
    assert code == 0, output
    assert '"rollout_id": "r1"' in out.read_text()


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_a_value_python_cannot_hold_is_a_clear_error_not_a_traceback(lake: Path, fmt: str) -> None:
    query = "select 'infinity'::timestamp as t, 'infinity'::date as d, 1 as x"
    res = CliRunner().invoke(app, ["sql", query, "--lake", str(lake), "--format", fmt])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.exception
    assert "column(s) t, d hold a value" in res.output and "t::varchar" in res.output
    cast = "select 'infinity'::timestamp::varchar as t, 'infinity'::date::varchar as d"
    shown = CliRunner().invoke(app, ["sql", cast, "--lake", str(lake), "--format", fmt])
    assert shown.exit_code == 0 and "infinity" in shown.output
    as_csv = CliRunner().invoke(app, ["sql", query, "--lake", str(lake), "--format", "csv"])
    assert as_csv.exit_code == 0 and as_csv.output.splitlines()[0] == '"t","d","x"'


def test_a_lake_folder_that_does_not_exist_is_refused(lake: Path, tmp_path: Path) -> None:
    typo = tmp_path / "lkae"
    res = CliRunner().invoke(app, ["sql", "select count(*) from rollouts", "--lake", str(typo)])
    output = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and "no lake there" in output and "clawpipe land" in output, output
    assert not typo.exists()
    assert _sql(lake, "--format", "csv")[0] == 0  # the real one still answers
