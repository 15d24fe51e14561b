"""The lake when its disk fills (a small tmpfs mounted under the lake): landing and compaction stop with an
error naming the lake and the space left, leave nothing half-visible and no temporary file, never tear the
manifest, and a rerun after space is freed lands every call exactly once."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from clawpipe import capture
from clawpipe.errors import CaptureError, LakeError
from clawpipe.lake import compact, land, manifest, run_audits, run_sql
from clawpipe.tables import LakeFS
from tests.lake import fixtures as fx
from tests.support.disk import fill, small_disk

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")

N_SEGMENTS, PER_SEGMENT = 6, 30


def captures(cap: Path) -> int:
    """Segments over three partitions, one with a damaged region (a reject), and a result line per rollout."""
    for s in range(N_SEGMENTS):
        frames = [
            fx.record(call_id=f"s{s}-c{i}", rollout_id=f"r{s}", seq=i, iteration=s % 3) for i in range(PER_SEGMENT)
        ]
        if s == 2:
            frames.insert(5, capture.SYNC + b"\xff" * 300)  # damage: one reject
        fx.write_segment(cap / f"proxy-{s:06d}.seg", frames)
    fx.write_results(cap, [fx.rollout_row(f"r{s}", iteration=s % 3) for s in range(N_SEGMENTS)])
    return N_SEGMENTS * PER_SEGMENT


def landed_by_manifest(cap: Path, lake: Path) -> set[tuple[str, int]]:
    """(segment, offset) of every call the manifest says is landed (its committed byte ranges)."""
    state = manifest.load(LakeFS(lake))
    out: set[tuple[str, int]] = set()
    for path in sorted(cap.glob("*.seg")):
        st = state.segments.get(path.stem)
        for item in capture.read_segment(path):
            if isinstance(item, capture.CaptureRecord) and st is not None and item.offset < st.end:
                out.add((path.stem, item.offset))
    return out


def visible(lake: Path) -> set[tuple[str, int]]:
    rows = run_sql(lake, 'select distinct segment, "offset" from model_calls').to_pylist()
    return {(r["segment"], r["offset"]) for r in rows}


def leftovers(lake: Path) -> list[str]:
    """Temporary files, staged folders' files and pending batch records: what a failed write must not leave."""
    out = [str(p.relative_to(lake)) for p in lake.rglob("*.inprogress")]
    out += [str(p.relative_to(lake)) for p in (lake / "_staging").rglob("*") if p.is_file()]
    out += [str(p.relative_to(lake)) for p in (lake / "_manifest").glob("pending-*")]
    return out


def assert_exactly_once(lake: Path, n_calls: int) -> None:
    got = run_sql(lake, "select count(*) as n, count(distinct call_id) as d from model_calls").to_pylist()
    assert got == [{"n": n_calls, "d": n_calls}]
    assert run_sql(lake, "select count(*) as n from rollouts").to_pylist() == [{"n": N_SEGMENTS}]
    assert run_sql(lake, "select count(*) as n from rejects").to_pylist() == [{"n": 1}]
    audits = run_audits(lake)
    assert {k: v.num_rows for k, v in audits.items()} == dict.fromkeys(audits, 0)


@pytest.mark.slow
def test_a_landing_that_fills_the_disk_stops_clearly_shows_nothing_half_and_lands_everything_on_rerun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(manifest, "CHECKPOINT_EVERY", 3)  # checkpoints are written too while the disk fills
    cap = tmp_path / "cap"
    n = captures(cap)
    sizing = tmp_path / "sizing"
    land(cap, sizing, batch_bytes=12_000, row_group_bytes=6_000)
    need = sum(p.stat().st_size for p in sizing.rglob("*") if p.is_file())
    failures, stages = 0, set()
    with small_disk(tmp_path / "disk", 2048) as disk:
        for k in range(14):  # from no room at all to almost enough: the disk fills at every stage of a landing
            lake = disk / f"lake{k}"
            lake.mkdir()
            filler = fill(disk, need * k // 14)
            try:
                land(cap, lake, batch_bytes=12_000, row_group_bytes=6_000)
            except LakeError as exc:
                failures += 1
                msg = str(exc)
                assert str(lake) in msg and "No space left on device" in msg and "bytes free" in msg, msg
                assert "rolled back" in msg and "run the landing again" in msg.lower()
                assert leftovers(lake) == []
                # readers see exactly what the manifest committed: no part of the failed batch, no torn manifest
                assert visible(lake) == landed_by_manifest(cap, lake)
                stages.add(len(visible(lake)) // 10)
            filler.unlink()
            land(cap, lake, batch_bytes=12_000, row_group_bytes=6_000)  # the rerun, with the space back
            assert_exactly_once(lake, n)
            assert leftovers(lake) == []
            shutil.rmtree(lake)
    assert failures >= 8 and len(stages) >= 4  # it failed often, and at different points of the landing


@pytest.mark.slow
def test_a_compaction_that_fills_the_disk_leaves_the_partition_as_it_was(tmp_path: Path) -> None:
    cap = tmp_path / "cap"
    n = captures(cap)
    with small_disk(tmp_path / "disk", 2048) as disk:
        lake = disk / "lake"
        land(cap, lake, batch_bytes=6_000, row_group_bytes=3_000)  # many small parts per partition
        before = sorted(str(p.relative_to(lake)) for p in lake.rglob("*.parquet"))
        rows_before = run_sql(lake, "select call_id, choice_index from model_calls order by all").to_pylist()
        filler = fill(disk, 8 << 10)
        with pytest.raises(LakeError) as info:
            compact(lake)
        msg = str(info.value)
        assert str(lake) in msg and "No space left on device" in msg and "bytes free" in msg, msg
        assert "unchanged" in msg
        assert sorted(str(p.relative_to(lake)) for p in lake.rglob("*.parquet")) == before
        assert run_sql(lake, "select call_id, choice_index from model_calls order by all").to_pylist() == rows_before
        assert leftovers(lake) == []
        filler.unlink()
        report = compact(lake)
        assert report.files_after < report.files_before
        assert_exactly_once(lake, n)
        # compacted parts have no call-id sidecar: the next landing into them builds one, on a full disk too
        fx.write_segment(cap / "proxy-late.seg", [fx.record(call_id=f"late{i}", seq=i) for i in range(5)])
        filler = fill(disk, 0)
        with pytest.raises(LakeError, match="No space left on device"):
            land(cap, lake)
        assert leftovers(lake) == []
        filler.unlink()
        land(cap, lake)
        assert_exactly_once(lake, n + 5)


def test_a_result_line_cut_by_a_full_disk_is_removed_and_the_next_one_lands(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", 64) as disk:
        path = disk / "results-b0.jsonl"
        capture.append_result(path, fx.rollout_row("r0"))
        filler = fill(disk, 0)
        with pytest.raises(CaptureError, match="No space left on device"):
            capture.append_result(path, fx.rollout_row("r1", stderr_tail="e" * 8000))  # more than the page left
        assert path.read_bytes().endswith(b"\n")  # no torn line for the next row to be glued to
        filler.unlink()
        capture.append_result(path, fx.rollout_row("r2"))
        rows = [row["rollout_id"] for _, row, bad in capture.read_results(path) if bad is None and row]
        assert rows == ["r0", "r2"]


def test_a_query_whose_spill_fills_the_temporary_folder_says_so_and_runs_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clawpipe.lake import query

    cap, lake = tmp_path / "cap", tmp_path / "lake"
    fx.write_segment(cap / "proxy-a.seg", [fx.record(call_id=f"c{i}", seq=i) for i in range(300)])
    land(cap, lake)
    runs: list[int] = []
    connect = query._connect_pinned
    monkeypatch.setattr(query, "_connect_pinned", lambda *a: runs.append(1) or connect(*a))  # count the tries
    with small_disk(tmp_path / "tmp", 2048) as tmp:
        monkeypatch.setattr(query.tempfile, "tempdir", str(tmp))
        big_sort = "select a.response || b.response as r from model_calls a, model_calls b order by r"
        with pytest.raises(LakeError) as info:
            run_sql(lake, big_sort, memory_mb=20, spill_mb=100, threads=1)
        msg = str(info.value)
        assert "No space left on device" in msg and f"temporary folder {tmp} (TMPDIR)" in msg, msg
        assert "--spill-mb" in msg and runs == [1]
        assert list(tmp.iterdir()) == []  # the query's spill folder is gone


@pytest.mark.slow
def test_a_landing_out_of_memory_stops_clearly_and_a_rerun_with_memory_lands_everything_once(tmp_path: Path) -> None:
    """A landing process under RLIMIT_AS that cannot buffer its row group: a LakeError saying so, nothing of
    the batch left; the rerun with memory lands every call exactly once."""
    import json
    import sys

    cap, lake = tmp_path / "cap", tmp_path / "lake"
    frames = []
    for i in range(40):  # 2 MB requests: a row group of 80 MB is buffered before anything is written
        request = json.dumps({"model": "m", "messages": [{"role": "user", "content": "y" * (2 << 20)}]}).encode()
        frames.append(
            capture.encode_record(fx.header(call_id=f"m{i}", seq=i), request, fx.response_body("chat", False))
        )
    fx.write_segment(cap / "proxy-a.seg", frames)
    code = (
        "import resource, sys\n"
        "from clawpipe.lake import land\n"
        "limit = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize() + (60 << 20)\n"
        "resource.setrlimit(resource.RLIMIT_AS, (limit, limit))\n"
        "land(sys.argv[1], sys.argv[2], batch_bytes=1 << 30, row_group_bytes=1 << 30)\n"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", code, str(cap), str(lake)], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1 and "LakeError" in proc.stderr, proc.stderr[-2000:]
    assert "out of memory" in proc.stderr and "row_group_bytes" in proc.stderr and str(lake) in proc.stderr
    assert leftovers(lake) == [] and not list(lake.rglob("*.parquet"))
    report = land(cap, lake)
    assert report.calls == 40
    got = run_sql(lake, "select count(*) as n, count(distinct call_id) as d from model_calls").to_pylist()
    assert got == [{"n": 40, "d": 40}]
