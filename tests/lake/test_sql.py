"""The real sql/analytics and sql/audits files over fixture rows, with the rows each must return;
and the read-only guard of ad hoc SQL."""

from __future__ import annotations

import hashlib
import re
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clawpipe import schemas, tables
from clawpipe.errors import LakeError
from clawpipe.lake import run_audits, run_saved, run_sql, saved_names


def _call(call_id: str, rollout_id: str, run: str = "A", it: int = 0, **kw: Any) -> dict[str, Any]:
    row = {
        "call_id": call_id,
        "choice_index": 0,
        "run_id": run,
        "iteration": it,
        "rollout_id": rollout_id,
        "api": "chat",
        "status": "ok",
        "http_status": 200,
        "policy_version": 1,
        "token_source": "upstream",
        "prompt_token_ids": [1, 2],
        "completion_token_ids": [3],
        "completion_logprobs": [-0.5],
    }
    row.update(kw)
    return row


def _rollout(rollout_id: str, run: str = "A", it: int = 0, **kw: Any) -> dict[str, Any]:
    row = {
        "rollout_id": rollout_id,
        "run_id": run,
        "iteration": it,
        "harness": "h1",
        "status": "succeeded",
        "eval": False,
    }
    row.update(kw)
    return row


def _write(lake: Path, table: str, rows: list[dict[str, Any]]) -> None:
    parts: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        parts.setdefault((r["run_id"], r["iteration"]), []).append(r)
    for (run, it), rs in parts.items():
        tables.replace_partition(lake, table, run, it, pa.Table.from_pylist(rs, schema=schemas.TABLES[table]))


@pytest.fixture
def lake(tmp_path: Path) -> Path:
    root = tmp_path / "lake"
    _write(
        root,
        "rollouts",
        [
            _rollout("ra1", reward=1.0),
            _rollout("ra2", status="failed", reward=0.0, error="boom\ntraceback"),
            _rollout("ra3", harness="h2", reward=0.5),
            _rollout("ra4", it=1, reward=0.25),
            _rollout("re1", it=1, reward=1.0, eval=True),
            _rollout("rb1", run="B", status="timeout", exit_code=-9),
        ],
    )
    _write(
        root,
        "model_calls",
        [
            _call("c1", "ra1", latency_ms=10.0, upstream_ms=8.0, prompt_tokens=5, completion_tokens=3),
            _call("c2", "ra1", latency_ms=20.0, upstream_ms=15.0, prompt_tokens=7, completion_tokens=2),
            _call("c2", "ra1", choice_index=1, latency_ms=20.0, upstream_ms=15.0, prompt_tokens=7, completion_tokens=4),
            _call(
                "c3",
                "ra2",
                policy_version=2,
                latency_ms=30.0,
                upstream_ms=25.0,
                prompt_tokens=6,
                completion_tokens=3,
                token_source="retokenized",
                completion_logprobs=None,
            ),
            _call(
                "c4",
                "ra2",
                policy_version=2,
                latency_ms=40.0,
                status="http_error",
                http_status=500,
                error="upstream 500",
                token_source="none",
                prompt_token_ids=None,
                completion_token_ids=None,
                completion_logprobs=None,
            ),
            _call(
                "c5",
                "rb1",
                run="B",
                api="messages",
                policy_version=2,
                latency_ms=50.0,
                upstream_ms=45.0,
                prompt_tokens=4,
                completion_tokens=1,
            ),
        ],
    )
    return root


def test_saved_queries_are_the_expected_set() -> None:
    assert set(saved_names()) >= {
        "reward_by_harness_iteration",
        "calls_tokens_per_rollout",
        "latency_by_policy_version",
        "retokenized_call_rate",
        "failure_reasons",
    }


def test_reward_by_harness_and_iteration(lake: Path) -> None:
    rows = run_saved(lake, "reward_by_harness_iteration").to_pylist()
    key = ("run_id", "harness", "iteration", "eval", "rollouts", "succeeded", "mean_reward", "min_reward", "max_reward")
    assert [tuple(r[k] for k in key) for r in rows] == [
        ("A", "h1", 0, False, 2, 1, 0.5, 0.0, 1.0),
        ("A", "h1", 1, False, 1, 1, 0.25, 0.25, 0.25),
        ("A", "h1", 1, True, 1, 1, 1.0, 1.0, 1.0),
        ("A", "h2", 0, False, 1, 1, 0.5, 0.5, 0.5),
        ("B", "h1", 0, False, 1, 0, None, None, None),
    ]
    assert rows[0]["std_reward"] == pytest.approx(0.5**0.5)
    only_b = run_saved(lake, "reward_by_harness_iteration", {"run_id": "B"}).to_pylist()
    assert [(r["run_id"], r["rollouts"]) for r in only_b] == [("B", 1)]


def test_calls_and_tokens_per_rollout(lake: Path) -> None:
    rows = run_saved(lake, "calls_tokens_per_rollout").to_pylist()
    assert rows == [
        {
            "rollout_id": "ra1",
            "run_id": "A",
            "iteration": 0,
            "calls": 2,
            "call_choices": 3,
            "prompt_tokens": 12,
            "completion_tokens": 9,
            "retokenized_calls": 0,
            "failed_calls": 0,
            "total_latency_ms": 30.0,
            "harness": "h1",
            "rollout_status": "succeeded",
            "reward": 1.0,
        },
        {
            "rollout_id": "ra2",
            "run_id": "A",
            "iteration": 0,
            "calls": 2,
            "call_choices": 2,
            "prompt_tokens": 6,
            "completion_tokens": 3,
            "retokenized_calls": 1,
            "failed_calls": 1,
            "total_latency_ms": 70.0,
            "harness": "h1",
            "rollout_status": "failed",
            "reward": 0.0,
        },
        {
            "rollout_id": "rb1",
            "run_id": "B",
            "iteration": 0,
            "calls": 1,
            "call_choices": 1,
            "prompt_tokens": 4,
            "completion_tokens": 1,
            "retokenized_calls": 0,
            "failed_calls": 0,
            "total_latency_ms": 50.0,
            "harness": "h1",
            "rollout_status": "timeout",
            "reward": None,
        },
    ]
    filtered = run_saved(lake, "calls_tokens_per_rollout", {"run_id": "A", "iteration": "0"}).to_pylist()
    assert [r["rollout_id"] for r in filtered] == ["ra1", "ra2"]
    assert run_saved(lake, "calls_tokens_per_rollout", {"iteration": "1"}).num_rows == 0


def test_latency_percentiles_by_policy_version(lake: Path) -> None:
    rows = run_saved(lake, "latency_by_policy_version").to_pylist()
    got = [
        (r["policy_version"], r["api"], r["calls"], r["p50_ms"], r["p90_ms"], r["max_ms"], r["p50_overhead_ms"])
        for r in rows
    ]
    assert got == [
        (1, "chat", 2, 15.0, pytest.approx(19.0), 20.0, 3.5),
        (2, "chat", 2, 35.0, pytest.approx(39.0), 40.0, 5.0),
        (2, "messages", 1, 50.0, 50.0, 50.0, 5.0),
    ]
    assert rows[0]["p99_ms"] == pytest.approx(19.9)


def test_retokenized_call_rate(lake: Path) -> None:
    rows = run_saved(lake, "retokenized_call_rate").to_pylist()
    assert rows == [
        {
            "run_id": "A",
            "iteration": 0,
            "calls": 4,
            "retokenized_calls": 1,
            "calls_without_ids": 1,
            "retokenized_rate": 0.25,
        },
        {
            "run_id": "B",
            "iteration": 0,
            "calls": 1,
            "retokenized_calls": 0,
            "calls_without_ids": 0,
            "retokenized_rate": 0.0,
        },
    ]


def test_failure_reasons(lake: Path) -> None:
    rows = run_saved(lake, "failure_reasons").to_pylist()
    assert [(r["level"], r["run_id"], r["status"], r["reason"], r["n"]) for r in rows] == [
        ("call", "A", "http_error", "upstream 500", 1),
        ("rollout", "A", "failed", "boom", 1),
        ("rollout", "B", "timeout", "exit code -9", 1),
    ]


def test_unknown_saved_query_or_parameter_is_refused(lake: Path) -> None:
    with pytest.raises(LakeError, match="no saved query"):
        run_saved(lake, "nope")
    with pytest.raises(LakeError, match="unknown"):
        run_saved(lake, "failure_reasons", {"harness": "x"})


def test_audits_pass_on_clean_rows(lake: Path) -> None:
    _write(lake, "rollouts", [_rollout("rb1", run="B", status="timeout", exit_code=-9)])
    results = run_audits(lake)
    assert set(results) >= {
        "calls_without_rollout",
        "completion_ids_logprobs_mismatch",
        "duplicate_call_ids",
        "duplicate_rollout_ids",
        "succeeded_without_reward",
    }
    assert {k: v.num_rows for k, v in results.items()} == dict.fromkeys(results, 0)


def test_audits_return_the_offending_rows(tmp_path: Path) -> None:
    root = tmp_path / "lake"
    _write(
        root, "rollouts", [_rollout("r1", reward=1.0), _rollout("r2", reward=None), _rollout("r1", it=1, reward=1.0)]
    )
    _write(
        root,
        "model_calls",
        [
            _call("ok", "r1"),
            _call("orphan", "ghost"),
            _call("short", "r1", completion_token_ids=[1, 2], completion_logprobs=[-1.0]),
            _call("twice", "r1"),
            _call("twice", "r1"),
        ],
    )
    r = {k: v.to_pylist() for k, v in run_audits(root).items()}
    assert [x["call_id"] for x in r["calls_without_rollout"]] == ["orphan"]
    assert r["completion_ids_logprobs_mismatch"] == [
        {"call_id": "short", "choice_index": 0, "run_id": "A", "iteration": 0, "n_ids": 2, "n_logprobs": 1}
    ]
    assert r["duplicate_call_ids"] == [{"call_id": "twice", "choice_index": 0, "copies": 2}]
    assert r["duplicate_rollout_ids"] == [{"rollout_id": "r1", "copies": 2}]
    assert [x["rollout_id"] for x in r["succeeded_without_reward"]] == ["r2"]


def test_calls_of_a_cut_off_attempt_that_ran_again_are_not_orphans(tmp_path: Path) -> None:
    """A kill cuts attempt 1 of rollout r1 and attempt 2 of r2 (calls, no result row); the resumed batch runs
    them again as r1.a2 and r2.a3. Their calls are not reported; a cut-off attempt that never ran again, one
    whose only later row is of another iteration, and an attempt newer than every row still are."""
    root = tmp_path / "lake"
    _write(
        root,
        "rollouts",
        [
            _rollout("r1.a2"),
            _rollout("r2.a3"),
            _rollout("r3.a2", it=1),
            _rollout("r4.a2", status="infra_error", reward=None),
        ],
    )
    calls = [_call("c1", "r1"), _call("c2", "r2.a2"), _call("c3", "r3"), _call("c4", "r4.a3"), _call("c5", "r5")]
    _write(root, "model_calls", calls)
    r = run_audits(root)["calls_without_rollout"].to_pylist()
    assert [x["call_id"] for x in r] == ["c3", "c4", "c5"]


ATTACKS = [
    # writes and DDL
    "insert into model_calls (call_id) values ('x')",
    "delete from rollouts",
    "update rollouts set reward = 1",
    "create table t as select 1",
    "create or replace view rollouts as select 1 as x",
    "drop view rollouts",
    "select 1; drop view rollouts",
    "with t as (select 1 as a) insert into rollouts (rollout_id) select a from t",
    # files
    "copy (select 1) to '{part}'",
    "copy (select 1) to '{part}' (format parquet)",
    "copy rollouts to '{lake}/rollouts/run_id=A/iteration=0/extra.parquet'",
    "copy rollouts to '{outside}/dump.csv'",
    "explain analyze copy (select 1) to '{part}'",
    "explain analyze select 1",
    "explain select 1",
    "export database '{outside}/export'",
    "import database '{outside}'",
    "select * from query('copy (select 1) to ''{part}''')",
    # databases, extensions, settings
    "attach '{lake}/x.duckdb' as x",
    "attach ':memory:' as m",
    "install httpfs",
    "load httpfs",
    "force install json",
    "pragma version",
    "pragma enable_profiling",
    "call pragma_version()",
    "checkpoint",
    "vacuum",
    "set enable_external_access = true",
    "reset lock_configuration",
    "set allowed_paths = ['/']",
    "use memory",
    "create secret (type s3, key_id 'a', secret 'b')",
    "update extensions",  # a statement kind the Python enum does not name
    "update extensions (httpfs)",
    "pivot rollouts on harness using count(*)",  # runs as several statements (creates an enum type first)
    # reading what is not the lake's tables, path tricks included
    "select * from read_text('/etc/hostname')",
    "select * from read_csv('{outside}/secret.csv')",
    "from '{outside}/secret.csv'",
    "select * from read_csv('{lake}/../secret.csv')",
    "select * from read_parquet('{lake}/rollouts/run_id=A/iteration=0/../../../../secret.parquet')",
    "select * from read_parquet('{outside}/secret.parquet')",
    "select * from glob('{lake}/**')",
    "select * from read_blob('{lake}/_manifest/*')",
    "select * from read_text('{lake}/rollouts/run_id=A/iteration=0')",
    "select * from read_json('/proc/self/environ')",
    "select * from sniff_csv('{outside}/secret.csv')",
]


_REFUSED = re.compile(
    r"read-only here|exactly one statement|reads the lake's tables and nothing else|Expected a single SELECT"
)


def _lake_bytes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def test_ad_hoc_sql_is_read_only_by_construction(lake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every write, attach, install, pragma, explain-analyze, copy, host-file read and path trick is refused
    with a clear error, and the lake stays byte-identical, also after a query over its rows that spills."""
    scratch = tmp_path / "scratch"  # the system's temporary folder (TMPDIR), where queries may spill
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.csv").write_text("a\n1\n")
    (tmp_path / "secret.csv").write_text("a\n1\n")
    pq.write_table(pa.table({"a": [1]}), tmp_path / "secret.parquet")
    pq.write_table(pa.table({"a": [1]}), outside / "secret.parquet")
    part = next((lake / "rollouts").rglob("*.parquet"))
    before = _lake_bytes(lake)
    for attack in ATTACKS:
        query = attack.format(lake=lake, part=part, outside=outside)
        with pytest.raises(LakeError) as info:
            run_sql(lake, query)
        message = str(info.value)
        assert _REFUSED.search(message), (query, message)
    # 6 rollouts x 300,000 hashes to sort: more than 48 MB of memory holds (with spill_mb=0 it fails)
    spilling = (
        "select count(*) from (select md5(r.rollout_id || i) as s from rollouts r, range(300000) t(i) order by s)"
    )
    assert run_sql(lake, spilling, memory_mb=48, spill_mb=1000, threads=1).column(0)[0].as_py() == 1_800_000
    assert list(scratch.iterdir()) == []  # the spill folder is gone with the query
    assert _lake_bytes(lake) == before
    assert sorted(p.name for p in outside.iterdir()) == ["secret.csv", "secret.parquet"]  # nothing written there
    assert run_sql(lake, "select count(*) from rollouts").column(0)[0].as_py() == 6


def test_plain_selects_still_run(lake: Path) -> None:
    part = next((lake / "rollouts").rglob("*.parquet"))
    for query in (
        "with x as (select 1 as a) select a from x",
        "select 1 union all select 2",
        "describe model_calls",
        "summarize rollouts",
        "select * from query('select count(*) from rollouts')",
        f"select count(*) from parquet_metadata('{part}')",
        "pivot rollouts on harness in ('h1', 'h2') using count(*)",
    ):
        assert run_sql(lake, query).num_rows >= 1, query


def test_a_pivot_without_values_is_refused_naming_the_fix(lake: Path) -> None:
    with pytest.raises(LakeError, match=r"PIVOT t ON col IN \('a', 'b'\)"):
        run_sql(lake, "pivot rollouts on harness using count(*)")


def test_a_query_larger_than_memory_fails_without_spilling_to_disk(
    lake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DuckDB spills to ./.tmp even with external access off: with spilling off (spill_mb=0) clawpipe sql spills
    nowhere and says what to do. (The memory cap is lowered so that a sort of 2M short rows exceeds it.)"""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(tempfile, "tempdir", str(cwd))
    with pytest.raises(LakeError, match=r"memory cap of 48 MB with spilling off.*filter or aggregate more"):
        run_sql(
            lake,
            "select count(*) from (select md5(i::varchar) as s from range(2000000) t(i) order by s)",
            memory_mb=48,
            spill_mb=0,
            threads=1,
        )
    assert list(cwd.iterdir()) == []
    assert run_sql(lake, "select count(*) from rollouts").column(0)[0].as_py() == 6


def test_ad_hoc_sql_reads_only_the_lake(lake: Path, tmp_path: Path) -> None:
    outside = tmp_path / "secret.csv"
    outside.write_text("a\n1\n")
    with pytest.raises(LakeError, match=r"[Pp]ermission"):
        run_sql(lake, f"select * from read_csv('{outside}')")
    assert run_sql(lake, "select count(*) from rollouts").column(0)[0].as_py() == 6


def test_bad_query_raises_duckdbs_message(lake: Path) -> None:
    with pytest.raises(LakeError, match=r'Binder Error.*"nope"'):
        run_sql(lake, "select nope from model_calls")
    with pytest.raises(LakeError, match="Parser Error"):
        run_sql(lake, "selec 1")


def test_views_have_schema_types(lake: Path) -> None:
    con = tables.connect(lake)
    types = dict(con.sql("select column_name, column_type from (describe model_calls)").fetchall())
    assert types["iteration"] == "INTEGER" and types["prompt_token_ids"] == "INTEGER[]"
    assert types["completion_logprobs"] == "FLOAT[]" and types["t_start"] == "TIMESTAMP WITH TIME ZONE"


def test_a_missing_table_is_answered_with_the_lakes_tables_and_install_is_named(lake: Path) -> None:
    # before: DuckDB's own suggestion ('Did you mean "pg_sequences"?') and "LOAD statements are refused"
    with pytest.raises(LakeError) as info:
        run_sql(lake, "select * from rollout")
    message = str(info.value)
    assert "Table with name rollout does not exist; the lake's tables: model_calls, rejects, rollouts" in message
    assert "pg_" not in message and "_empty" not in message
    with pytest.raises(LakeError, match="INSTALL and LOAD statements are refused; use SELECT"):
        run_sql(lake, "INSTALL httpfs")
