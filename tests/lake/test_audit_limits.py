"""Audits run under the limits of ``clawpipe sql``: a time limit (none by default) and the memory cap, each
named in the failure with the audit it stopped."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from clawpipe import schemas, tables
from clawpipe.cli import app
from clawpipe.errors import LakeError
from clawpipe.lake import run_audits
from clawpipe.sqlfiles import sql_names


@pytest.fixture
def lake(tmp_path: Path) -> Path:
    rows = [
        {"call_id": f"c{i}", "choice_index": 0, "run_id": "A", "iteration": 0, "rollout_id": f"r{i % 7}"}
        for i in range(2000)
    ]
    tables.replace_partition(tmp_path, "model_calls", "A", 0, pa.Table.from_pylist(rows, schemas.MODEL_CALLS))
    return tmp_path


def test_audits_pass_without_a_time_limit_and_stop_at_one_naming_the_audit(lake: Path) -> None:
    results = run_audits(lake)
    assert sorted(results) == sorted(sql_names("audits"))
    first = sorted(sql_names("audits"))[0]
    with pytest.raises(LakeError, match=rf"audit {first} failed: the query ran past its time limit of 1e-09 s"):
        run_audits(lake, timeout_s=1e-9)


def test_lake_check_takes_the_limits(lake: Path) -> None:
    out = CliRunner().invoke(app, ["lake", "check", "--lake", str(lake), "--timeout-s", "0.000000001"])
    assert out.exit_code == 1 and "ran past its time limit" in out.output, out.output
    bad = CliRunner().invoke(app, ["lake", "check", "--lake", str(lake), "--memory-mb", "0"])
    assert bad.exit_code == 2 and "--memory-mb" in bad.output
    ok = CliRunner().invoke(app, ["lake", "check", "--lake", str(lake), "--memory-mb", "512"])
    assert "audits passed" in ok.output, ok.output
