"""Compaction merges parts atomically without losing or doubling rows; lakes on filesystem URLs work."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pyarrow as pa
import pytest

from clawpipe import schemas
from clawpipe.lake import compact, land, run_audits, run_sql
from clawpipe.tables import LakeFS
from tests.lake import fixtures as fx


def _land_in_rounds(cap: Path, lake: str | Path, rounds: int, per_round: int) -> int:
    for r in range(rounds):
        fx.write_segment(cap / f"p-{r:06d}.seg", [fx.record(call_id=f"r{r}-{i}", seq=i) for i in range(per_round)])
        land(cap, lake)
    return rounds * per_round


def _snapshot(lake: str | Path) -> list[tuple]:
    rows = run_sql(lake, "select call_id, choice_index, response, completion_token_ids from model_calls").to_pylist()
    return sorted((r["call_id"], r["choice_index"], r["response"], tuple(r["completion_token_ids"])) for r in rows)


def test_compaction_merges_parts_and_keeps_rows(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    n = _land_in_rounds(cap, lake, 5, 7)
    part_dir = lake / "model_calls" / "run_id=run1" / "iteration=0"
    assert len(list(part_dir.glob("*.parquet"))) == 5
    before = _snapshot(lake)
    rep = compact(lake)
    assert (rep.partitions, rep.files_before, rep.files_after, rep.rows) == (1, 5, 1, n)
    assert len(list(part_dir.glob("*.parquet"))) == 1
    assert _snapshot(lake) == before
    assert compact(lake).partitions == 0  # nothing left to merge
    assert land(cap, lake).calls == 0  # the manifest still knows what landed
    fx.write_segment(cap / "late.seg", [fx.record(call_id="r0-0"), fx.record(call_id="late")])
    rep2 = land(cap, lake)
    assert (rep2.calls, rep2.duplicates) == (1, 1)


def test_compaction_drops_duplicate_calls(tmp_path: Path) -> None:
    lake = LakeFS(tmp_path / "lake")
    rows = [{"call_id": "a", "choice_index": 0, "run_id": "R", "iteration": 0, "rollout_id": "x"}]
    t = pa.Table.from_pylist(rows, schema=schemas.MODEL_CALLS)
    for _ in range(3):
        lake.write_parquet(f"model_calls/run_id=R/iteration=0/part-{uuid.uuid4().hex}.parquet", t)
    rep = compact(tmp_path / "lake")
    assert (rep.rows, rep.duplicates_dropped) == (1, 2)
    assert run_sql(tmp_path / "lake", "select count(*) from model_calls").column(0)[0].as_py() == 1


def test_readers_never_see_a_half_compacted_partition(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    n = 0
    seen: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                seen.append(run_sql(lake, "select count(*) from model_calls").column(0)[0].as_py())
            except BaseException as exc:  # asserted below: a reader must never fail mid-compaction
                errors.append(exc)
                return

    n = _land_in_rounds(cap, lake, 6, 5)
    reader = threading.Thread(target=read)
    reader.start()
    try:
        for r in range(4):  # new parts, then a compaction, repeatedly, while the reader reads
            fx.write_segment(cap / f"q-{r}.seg", [fx.record(call_id=f"q{r}-{i}") for i in range(5)])
            land(cap, lake)
            n += 5
            compact(lake)
    finally:
        stop.set()
        reader.join()
    assert not errors, errors
    assert seen and all(c % 5 == 0 and 30 <= c <= n for c in seen), sorted(set(seen))
    assert run_sql(lake, "select count(*) from model_calls").column(0)[0].as_py() == n


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_lake_on_a_filesystem_url(tmp_path: Path, scheme: str) -> None:
    cap = tmp_path / "cap"
    url = f"file://{tmp_path / 'lake'}" if scheme == "file" else f"memory://lake-{uuid.uuid4().hex[:8]}"
    fx.write_results(cap, [fx.rollout_row("r0"), fx.rollout_row("r1")])
    n = _land_in_rounds(cap, url, 3, 4)
    assert land(cap, url).calls == 0
    got = run_sql(url, "select count(*) as n, count(distinct call_id) as d from model_calls").to_pylist()[0]
    assert got == {"n": n, "d": n}
    assert run_sql(url, "select count(*) from rollouts").column(0)[0].as_py() == 2
    rep = compact(url)
    assert (rep.files_before, rep.files_after) == (3, 1)
    assert run_sql(url, "select count(*) from model_calls").column(0)[0].as_py() == n
    audits = run_audits(url)
    assert audits["duplicate_call_ids"].num_rows == 0
    if scheme == "file":
        assert len(list((tmp_path / "lake" / "model_calls").rglob("*.parquet"))) == 1
    else:
        lake = LakeFS(url)
        assert len(lake.list_files("model_calls", suffix=".parquet")) == 1
        assert lake.list_files("_manifest", suffix=".json")
