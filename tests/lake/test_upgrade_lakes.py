"""Data written by earlier (and later) clawpipe versions, read and extended by this one.

The old captures and lakes under tests/lake/upgrade/ were written by the code of three earlier revisions
(tests/lake/upgrade/make_fixtures.py runs each revision's own landing and tree building): an early one
(``CPR1`` frames, ``tree_stats.retokenized_calls``, no ``tree_sequences``), a middle one (frames with sync
markers, ``kept_out_*``, ``tree_sequences``) and the last before ``model_calls.spliced_tokens``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clawpipe import capture, schemas, sqlfiles, tables
from clawpipe.errors import LakeError
from clawpipe.lake import compact, land, run_audits, run_saved, run_sql, saved_names
from clawpipe.lake.query import query_params
from tests.lake import fixtures as fx

UPGRADE = Path(__file__).parent / "upgrade"
VERSIONS = ("early", "middle", "before_spliced")
OLD_RUN = "old-run"


def _old(tmp_path: Path, version: str) -> Path:
    """A copy of what ``version`` wrote: ``lake/``, its landed captures and the captures it left unlanded."""
    dest = tmp_path / version
    shutil.copytree(UPGRADE / version, dest)
    return dest


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _ids(lake: Path) -> list[str]:
    return run_sql(lake, "select call_id from model_calls order by call_id").column(0).to_pylist()


@pytest.mark.parametrize("version", VERSIONS)
def test_old_captures_land_into_the_old_lake_every_call_once(tmp_path: Path, version: str) -> None:
    old = _old(tmp_path, version)
    lake = old / "lake"
    before = _ids(lake)
    assert len(before) == 5  # 2 rollouts x 2 calls and one failed call, landed by the old code
    # the old manifest is honoured: what the old version landed is not landed again
    again = land(old / "landed", lake)
    assert (again.calls, again.rows, again.rejects) == (0, 0, 0)
    # the captures the old proxy wrote but nobody landed yet (its framing and header keys)
    rep = land(old / "pending", lake)
    assert (rep.calls, rep.rejects, rep.rollouts, rep.damaged_bytes) == (4, 0, 2, 0)
    after = _ids(lake)
    assert len(after) == len(set(after)) == 9 and set(before) < set(after)
    assert land(old / "pending", lake).calls == 0


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_new_calls_in_an_old_partition_read_with_new_columns_null_through_queries_audits_and_compaction(
    tmp_path: Path, version: str
) -> None:
    old = _old(tmp_path, version)
    lake = old / "lake"
    new = tmp_path / "new-captures"
    fx.write_segment(
        new / "p-1.seg", [fx.record(run_id=OLD_RUN, iteration=0, rollout_id="new-r9", seq=k) for k in range(2)]
    )
    fx.write_results(new, [fx.rollout_row("new-r9", run_id=OLD_RUN, iteration=0)])
    assert land(new, lake).calls == 2
    part_dir = lake / "model_calls" / f"run_id={OLD_RUN}" / "iteration=0"
    schemas_in_partition = [pq.read_schema(p) for p in sorted(part_dir.glob("*.parquet"))]
    assert len(schemas_in_partition) == 2  # the old version's part and this one's
    assert any("spliced_tokens" not in s.names for s in schemas_in_partition)

    def check() -> None:
        rows = run_sql(
            lake,
            "select rollout_id = 'new-r9' as new, count(*) as n, count(spliced_tokens) as spliced, "
            "count(proxy_policy_version) as stamped, count(prompt_token_ids) as with_ids "
            "from model_calls group by 1 order by 1",
        ).to_pylist()
        old_rows, new_rows = rows
        # a column the old version did not have reads NULL; what it had reads as written (its failed call: no ids)
        assert old_rows["n"] == 5 and old_rows["spliced"] == 0
        assert old_rows["with_ids"] == 4 and new_rows == {
            "new": True,
            "n": 2,
            "spliced": 0,
            "stamped": 2,
            "with_ids": 2,
        }
        # proxy_policy_version came with the last revision: its rows carry it, earlier ones read NULL
        assert old_rows["stamped"] == (5 if version == "before_spliced" else 0)
        for name in saved_names():
            run_saved(lake, name)  # every saved query runs over both parts
        failing = {name: t.num_rows for name, t in run_audits(lake).items() if t.num_rows}
        assert failing == {}

    check()
    rep = compact(lake)
    assert (rep.files_before, rep.files_after, rep.rows, rep.duplicates_dropped) == (2, 1, 7, 0)
    (merged,) = part_dir.glob("*.parquet")
    assert pq.read_schema(merged).names[: len(schemas.MODEL_CALLS)] == schemas.MODEL_CALLS.names
    check()


# a value for each $parameter the sql/ files take, naming what the old lakes hold
PARAMS = {"run_id": OLD_RUN, "iteration": 0, "scope": "", "group_ids": ["g0"], "all_groups": True}


@pytest.mark.parametrize("version", VERSIONS)
def test_every_sql_file_runs_over_an_old_lake(version: str) -> None:
    lake = UPGRADE / version / "lake"  # read only
    con = tables.connect(lake)
    ran = {}
    for folder in ("analytics", "audits", "common", "pipeline", "train", "trees"):
        for name in sqlfiles.sql_names(folder):
            sql = sqlfiles.sql_text(f"{folder}/{name}")
            params = {p: PARAMS.get(p, "rollout:old-r0" if p == "tree_id" else None) for p in query_params(sql)}
            ran[f"{folder}/{name}"] = len(con.execute(sql, params).fetchall())
    # what the old version landed is found: its calls, rollouts and trees
    assert ran["trees/calls"] == 5 and ran["common/latest_rollouts"] == 2 and ran["trees/list"] == 3


def test_early_tree_stats_read_the_renamed_count_as_the_new_columns(tmp_path: Path) -> None:
    lake = _old(tmp_path, "early") / "lake"
    stats = run_sql(
        lake,
        "select tree_id, retokenized_calls, kept_out_retokenized, kept_out_no_ids from tree_stats order by tree_id",
    ).to_pylist()
    assert len(stats) == 3  # the group and its two rollouts
    for row in stats:
        # one old count of every kept-out call: 0 is 0 of each kind; 1 (the failed call) cannot be split
        if row["retokenized_calls"] == 0:
            assert (row["kept_out_retokenized"], row["kept_out_no_ids"]) == (0, 0)
        else:
            assert (row["kept_out_retokenized"], row["kept_out_no_ids"]) == (None, None)
    assert sorted(r["retokenized_calls"] for r in stats) == [0, 1, 1]  # the group and rollout tree of r0
    # the trees room's listing and the tree-label audit read it
    con = tables.connect(lake)
    listed = con.execute(sqlfiles.sql_text("trees/list"), {"run_id": OLD_RUN, "iteration": 0, "scope": ""}).fetchall()
    assert len(listed) == 3
    assert run_audits(lake)["tree_labels_outside_their_rollout"].num_rows == 0
    assert run_sql(lake, "select count(*) from tree_sequences").column(0).to_pylist() == [0]


def test_a_lake_in_a_later_format_is_refused_naming_the_version_and_left_as_it_was(tmp_path: Path) -> None:
    old = _old(tmp_path, "middle")
    lake = old / "lake"
    land(old / "pending", lake)
    marker = json.loads((lake / tables.FORMAT_FILE).read_bytes())
    assert marker["format"] == tables.LAKE_FORMAT  # a landing marks the lake it writes
    (lake / tables.FORMAT_FILE).write_text(
        json.dumps({"format": tables.LAKE_FORMAT + 1, "written_by": "clawpipe 9.4.0"})
    )
    before = _files(lake)
    said = rf"in format {tables.LAKE_FORMAT + 1}, written by clawpipe 9\.4\.0; this clawpipe .* use clawpipe 9\.4\.0"
    with pytest.raises(LakeError, match=said):
        run_sql(lake, "select count(*) from model_calls")
    with pytest.raises(LakeError, match=said):
        run_audits(lake)
    with pytest.raises(LakeError, match=said):
        compact(lake, min_files=1)
    fresh = tmp_path / "more"
    fx.write_segment(fresh / "m-1.seg", [fx.record(run_id=OLD_RUN, iteration=0, rollout_id="x")])
    with pytest.raises(LakeError, match=said):
        land(fresh, lake)
    with pytest.raises(LakeError, match=said):
        tables.replace_partition(lake, "tree_stats", OLD_RUN, 0, schemas.TREE_STATS.empty_table())
    after = _files(lake)
    after.pop("_manifest/.lock", None)
    before.pop("_manifest/.lock", None)
    assert after == before  # nothing rolled back, rewritten or added


def _add_part_with_a_later_column(part_dir: Path, rows: pa.Table) -> None:
    """A part as a later clawpipe would write it: today's columns and one more."""
    later = rows.append_column("judge_score", pa.array([0.25 * (k + 1) for k in range(rows.num_rows)], pa.float64()))
    pq.write_table(later, part_dir / "part-later.parquet")


def test_a_column_from_a_later_version_is_read_and_kept_by_compaction_and_rollout_merges(tmp_path: Path) -> None:
    caps, lake = tmp_path / "cap", tmp_path / "lake"
    fx.write_segment(caps / "a-1.seg", [fx.record(run_id="r", rollout_id="a", seq=k) for k in range(3)])
    fx.write_results(caps, [fx.rollout_row("a", run_id="r")])
    land(caps, lake)
    calls_dir = lake / "model_calls" / "run_id=r" / "iteration=0"
    later_calls = fx.record(run_id="r", rollout_id="b", call_id="later-1")
    # the later version's rows: land them with this one elsewhere, then add the later column
    other = tmp_path / "other"
    fx.write_segment(other / "cap" / "b-1.seg", [later_calls])
    land(other / "cap", other / "lake")
    (b_part,) = (other / "lake" / "model_calls" / "run_id=r" / "iteration=0").glob("*.parquet")
    _add_part_with_a_later_column(calls_dir, pq.read_table(b_part))

    query = "select call_id, judge_score from model_calls order by call_id"
    seen = run_sql(lake, query).to_pylist()
    assert [r["judge_score"] for r in seen if r["call_id"] == "later-1"] == [0.25]
    assert sum(r["judge_score"] is None for r in seen) == 3
    rep = compact(lake)
    assert (rep.files_before, rep.files_after, rep.rows) == (2, 1, 4)
    (merged,) = calls_dir.glob("*.parquet")
    assert "judge_score" in pq.read_schema(merged).names
    assert run_sql(lake, query).to_pylist() == seen

    # rollouts: a partition rewritten by a landing keeps the later column of the rows it had
    roll_dir = lake / "rollouts" / "run_id=r" / "iteration=0"
    (old_part,) = roll_dir.glob("*.parquet")
    rows = pq.read_table(old_part)
    old_part.unlink()
    _add_part_with_a_later_column(roll_dir, rows)
    more = tmp_path / "cap2"
    fx.write_results(more, [fx.rollout_row("b", run_id="r")], batch="b1")
    assert land(more, lake).rollouts == 1
    got = run_sql(lake, "select rollout_id, judge_score from rollouts order by rollout_id").to_pylist()
    assert got == [{"rollout_id": "a", "judge_score": 0.25}, {"rollout_id": "b", "judge_score": None}]


def test_a_segment_in_a_later_framing_is_held_back_unlanded_naming_it(tmp_path: Path) -> None:
    caps, lake = tmp_path / "cap", tmp_path / "lake"
    later = fx.record(run_id="r", rollout_id="a", call_id="from-later").replace(capture.SYNC, b"\xa9CPR3\x00\x5a\xe1")
    fx.write_segment(caps / "later-1.seg", [later])
    fx.write_segment(caps / "now-1.seg", [fx.record(run_id="r", rollout_id="a", call_id="from-now")])
    for _ in range(2):  # held back again on the next landing: never consumed, never a reject
        with pytest.raises(
            LakeError, match=r"held back 1 captures written by a later clawpipe .*later-1 \(framing CPR3\)"
        ):
            land(caps, lake)
    assert _ids(lake) == ["from-now"]
    assert run_sql(lake, "select count(*) from rejects").column(0).to_pylist() == [0]


def test_a_part_whose_column_changed_type_stops_compaction_naming_it_and_leaves_the_partition(tmp_path: Path) -> None:
    caps, lake = tmp_path / "cap", tmp_path / "lake"
    fx.write_segment(caps / "a-1.seg", [fx.record(run_id="r", rollout_id="a", seq=k) for k in range(2)])
    land(caps, lake)
    calls_dir = lake / "model_calls" / "run_id=r" / "iteration=0"
    (part,) = calls_dir.glob("*.parquet")
    rows = pq.read_table(part)
    # a later version writing `seq` as text: a value this one cannot cast into its int64 column
    later = rows.set_column(rows.schema.get_field_index("seq"), "seq", pa.array(["7a", "7b"]))
    later = later.set_column(0, "call_id", pa.array(["later-1", "later-2"]))
    pq.write_table(later, calls_dir / "part-zz-later.parquet")  # merged after the part this version wrote
    before = _files(lake)
    with pytest.raises(LakeError, match=r"compacting .*iteration=0 stopped: a part holds a column of another type"):
        compact(lake)
    assert _files(lake) == before  # the partition as it was, nothing staged left behind
    assert not list((lake / "_staging").glob("*"))
