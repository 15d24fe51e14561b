"""``clawpipe land``, ``clawpipe sql`` (formats, saved queries, errors) and ``clawpipe lake check|compact``."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from clawpipe.cli import app
from clawpipe.sqlfiles import sql_names
from tests.lake import fixtures as fx

ROOT = Path(__file__).resolve().parents[2]


def _populate(home: Path, with_rollouts: bool = True) -> None:
    cap = home / "captures"
    fx.write_segment(
        cap / "p-000001.seg",
        [fx.record(api, False, rollout_id="r0", seq=i, call_id=f"c{i}") for i, api in enumerate(fx.APIS)],
    )
    if with_rollouts:
        fx.write_results(cap, [fx.rollout_row("r0", reward=0.75)])


def _run_sql(query: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`python -m clawpipe sql QUERY` in a real subprocess (so DuckDB's message reaches stderr)."""
    return subprocess.run(
        [sys.executable, "-m", "clawpipe", "sql", query], cwd=ROOT, env=env, capture_output=True, text=True
    )


def test_land_then_query_in_every_format(home: Path, tmp_path: Path) -> None:
    _populate(home)
    runner = CliRunner()
    res = runner.invoke(app, ["land"])
    assert res.exit_code == 0, res.output
    assert "landed 4 calls (4 rows), 1 rollout rows, 0 rejects" in res.output
    assert "landed 0 calls" in runner.invoke(app, ["land"]).output

    q = "select api, completion_token_ids as ids from model_calls order by seq"
    table = runner.invoke(app, ["sql", q])
    assert table.exit_code == 0 and "(4 rows)" in table.output and "messages" in table.output
    as_csv = runner.invoke(app, ["sql", q, "--format", "csv"])
    assert next(iter(csv.DictReader(io.StringIO(as_csv.output)))) == {"api": "chat", "ids": "[7, 8, 9]"}
    as_json = runner.invoke(app, ["sql", q, "--format", "json"])
    assert [json.loads(line) for line in as_json.output.splitlines()][3] == {"api": "messages", "ids": [7, 8, 9]}
    out = tmp_path / "calls.parquet"
    res = runner.invoke(app, ["sql", q, "--format", "parquet", "--out", str(out)])
    assert res.exit_code == 0 and pq.read_table(out).num_rows == 4

    saved = runner.invoke(
        app, ["sql", "--saved", "reward_by_harness_iteration", "--param", "run_id=run1", "--format", "json"]
    )
    assert saved.exit_code == 0, saved.output
    row = json.loads(saved.output.splitlines()[0])
    assert (row["run_id"], row["rollouts"], row["mean_reward"]) == ("run1", 1, 0.75)
    listing = runner.invoke(app, ["lake", "saved"])
    assert "calls_tokens_per_rollout  [$iteration, $run_id]" in listing.output


@pytest.mark.slow
def test_sql_errors_exit_non_zero_with_duckdbs_message(home: Path) -> None:
    _populate(home)
    env = {**os.environ, "CLAWPIPE_HOME": str(home)}
    assert CliRunner().invoke(app, ["land"]).exit_code == 0
    bad = _run_sql("select nope from model_calls", env)
    assert bad.returncode != 0
    assert 'Binder Error: Referenced column "nope" not found' in bad.stderr
    write = _run_sql("drop view model_calls", env)
    assert write.returncode != 0 and "read-only" in write.stderr
    runner = CliRunner()
    assert runner.invoke(app, ["sql", "--saved", "nope"]).exit_code != 0
    assert runner.invoke(app, ["sql"]).exit_code != 0


def test_lake_check_and_compact(home: Path) -> None:
    _populate(home, with_rollouts=False)
    runner = CliRunner()
    runner.invoke(app, ["land"])
    failing = runner.invoke(app, ["lake", "check"])
    assert failing.exit_code == 1
    n = len(sql_names("audits"))
    assert "FAIL calls_without_rollout: 4 offending rows" in failing.output
    assert f"{n - 1}/{n} audits passed" in failing.output
    fx.write_results(home / "captures", [fx.rollout_row("r0")])
    fx.write_segment(home / "captures" / "p-000002.seg", [fx.record(rollout_id="r0", call_id="more")])
    runner.invoke(app, ["land"])
    passing = runner.invoke(app, ["lake", "check"])
    assert passing.exit_code == 0 and f"{n}/{n} audits passed" in passing.output
    res = runner.invoke(app, ["lake", "compact"])
    assert res.exit_code == 0 and "compacted 1 partitions: 2 -> 1 files, 5 rows" in res.output
    count = runner.invoke(app, ["sql", "select count(*) as n from model_calls", "--format", "csv"])
    assert count.output.splitlines() == ['"n"', "5"]


def test_land_reports_damage_and_goes_on(home: Path) -> None:
    frames = [fx.record(call_id=f"c{i}", seq=i) for i in range(4)]
    bad = bytearray(frames[1])
    bad[len(bad) // 2] ^= 0xFF
    fx.write_segment(home / "captures" / "d-000001.seg", [frames[0], bytes(bad), *frames[2:]])
    res = CliRunner().invoke(app, ["land"])
    assert res.exit_code == 0, res.output
    assert "landed 3 calls (3 rows), 0 rollout rows, 1 rejects" in res.output
    assert f"{len(bad)} capture bytes in damaged regions (each one reject)" in res.output
