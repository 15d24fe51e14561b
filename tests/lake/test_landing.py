"""Landing is exactly once: re-landing adds nothing, growing and sealed segments land each call once,
bad records become rejects with their position, and the latest rollout attempt wins."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from clawpipe import capture
from clawpipe.lake import land, run_audits, run_sql, sources
from tests.lake import fixtures as fx


def _count(lake: Path, sql: str = "select count(*) from model_calls") -> int:
    return run_sql(lake, sql).column(0)[0].as_py()


def test_relanding_adds_nothing(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    fx.write_segment(cap / "a-000001.seg", [fx.record(rollout_id=f"r{i}", seq=i) for i in range(20)])
    fx.write_results(cap, [fx.rollout_row(f"r{i}") for i in range(20)])
    first = land(cap, lake)
    assert (first.calls, first.rollouts, first.rejects) == (20, 20, 0)
    parts = sorted(p.name for p in lake.rglob("*.parquet"))
    second = land(cap, lake)
    assert (second.calls, second.rollouts, second.batches, second.bytes) == (0, 0, 0, 0)
    assert sorted(p.name for p in lake.rglob("*.parquet")) == parts
    assert _count(lake) == 20 and _count(lake, "select count(*) from rollouts") == 20
    assert all(t.num_rows == 0 for t in run_audits(lake).values())


def test_open_segment_lands_complete_frames_then_the_rest_once_sealed(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    frames = [fx.record(seq=i, call_id=f"c{i}") for i in range(6)]
    seg = fx.write_segment(cap / "p-000001.open", [*frames[:3], frames[3][:40]])  # torn tail: a write in progress
    r1 = land(cap, lake)
    assert (r1.calls, r1.rejects) == (3, 0)
    with open(seg, "r+b") as f:  # the writer finishes frame 3 and appends more
        f.truncate(sum(map(len, frames[:3])))
        f.seek(0, os.SEEK_END)
        f.write(b"".join(frames[3:5]))
    assert land(cap, lake).calls == 2
    with open(seg, "ab") as f:
        f.write(frames[5])
    capture.seal_segment(seg)
    r3 = land(cap, lake)
    assert r3.calls == 1
    got = run_sql(lake, "select call_id from model_calls order by seq").column(0).to_pylist()
    assert got == [f"c{i}" for i in range(6)]
    assert land(cap, lake).calls == 0


def test_same_call_in_two_segments_lands_once(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    rec = fx.record(call_id="dup")
    fx.write_segment(cap / "a-1.seg", [rec])
    fx.write_segment(cap / "b-1.seg", [rec, fx.record(call_id="other")])
    rep = land(cap, lake)
    assert (rep.calls, rep.duplicates) == (2, 1)
    fx.write_segment(cap / "c-1.seg", [rec])  # later, in a new landing run
    assert land(cap, lake).duplicates == 1
    assert _count(lake) == 2


def test_bad_records_become_rejects_with_position(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    good = fx.record(call_id="good")
    no_rollout = fx.header(call_id="bad1")
    del no_rollout["rollout_id"]
    bad_header = capture.encode_record(no_rollout, b"{}", fx.response_body("chat", False))
    not_json = capture.encode_record(fx.header(call_id="bad2"), b"{}", b"<html>oops</html>")
    bad_seq = capture.encode_record(
        {**fx.header(call_id="bad3"), "seq": "first"}, b"{}", fx.response_body("chat", False)
    )
    frames = [good, bad_header, not_json, bad_seq]
    damaged = bytearray(fx.record(call_id="damaged"))
    damaged[-5] ^= 0xFF  # checksum mismatch in a sealed segment
    fx.write_segment(cap / "s-1.seg", [*frames, bytes(damaged), fx.record(call_id="after")])
    rep = land(cap, lake)
    assert (rep.calls, rep.rejects) == (2, 4)  # the record after the damaged one lands too
    assert _count(lake, "select count(*) from model_calls where call_id = 'after'") == 1
    offsets = [0]
    for f in frames:
        offsets.append(offsets[-1] + len(f))
    rows = run_sql(lake, 'select source, "offset", reason, record from rejects order by "offset"').to_pylist()
    assert [(r["source"], r["offset"]) for r in rows] == [("s-1", o) for o in offsets[1:5]]
    reasons = [r["reason"] for r in rows]
    assert "rollout_id" in reasons[0]
    assert "not JSON" in reasons[1]
    assert "seq" in reasons[2]
    assert "checksum" in reasons[3] and f"{len(damaged)} bytes" in reasons[3]
    assert "bad1" in rows[0]["record"]
    assert land(cap, lake).rejects == 0  # rejects are not repeated either
    assert _count(lake, "select count(*) from rejects") == 4


def test_bad_result_lines_are_rejected(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    path = fx.write_results(cap, [fx.rollout_row("r0")])
    with open(path, "ab") as f:
        f.write(b"{not json}\n")
        f.write(json.dumps(fx.rollout_row("r1", reward="lots")).encode() + b"\n")
        f.write(b'{"rollout_id": "torn')  # a write in progress: neither landed nor rejected
    rep = land(cap, lake)
    assert (rep.rollouts, rep.rejects) == (1, 2)
    assert (
        run_sql(lake, 'select reason from rejects order by "offset"').column(0).to_pylist()[0].startswith("bad result")
    )
    with open(path, "ab") as f:
        f.write(b'", "run_id": "run1", "iteration": 0, "status": "failed"}\n')
    assert land(cap, lake).rollouts == 1
    assert _count(lake, "select count(*) from rollouts") == 2


def test_results_files_are_listed_oldest_first_with_their_size_and_no_symlinked_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    newer = fx.write_results(cap, [fx.rollout_row("r1")], batch="b1")
    older = fx.write_results(cap, [fx.rollout_row("r0"), fx.rollout_row("r2")], batch="b0")
    os.utime(older, ns=(1_000_000_000, 1_000_000_000))
    outside = tmp_path / "elsewhere"
    fx.write_results(outside, [fx.rollout_row("r9")], batch="b9")
    (cap / "results" / "linked").symlink_to(outside / "results", target_is_directory=True)
    (cap / "results" / "notes.txt").write_text("not a results file")
    os.mkfifo(cap / "results" / "pipe.jsonl")  # not a regular file: never opened
    listed = sources.list_results(cap)
    assert [(r.key, r.path, r.size) for r in listed] == [
        (str(older.relative_to(cap)), older, older.stat().st_size),
        (str(newer.relative_to(cap)), newer, newer.stat().st_size),
    ]
    assert land(cap, lake).rollouts == 3
    # a landed file no longer than the manifest's offset is skipped unopened
    read = []
    real_read = sources.read_result_lines
    monkeypatch.setattr(sources, "read_result_lines", lambda path, start: read.append(path) or real_read(path, start))
    assert land(cap, lake).rollouts == 0 and read == []
    with open(newer, "ab") as f:
        f.write(json.dumps(fx.rollout_row("r3")).encode() + b"\n")
    assert land(cap, lake).rollouts == 1 and read == [newer]
    assert _count(lake, "select count(*) from rollouts") == 4


def test_latest_rollout_attempt_wins(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    fx.write_results(cap, [fx.rollout_row("r0", status="infra_error", reward=None, attempt=0)], batch="b0")
    land(cap, lake)
    fx.write_results(cap, [fx.rollout_row("r0", status="succeeded", reward=0.5, attempt=1)], batch="b1")
    fx.write_results(cap, [fx.rollout_row("r1", reward=0.25)], batch="b1")
    land(cap, lake)
    # a stale re-append of the first attempt does not undo the retry
    fx.write_results(cap, [fx.rollout_row("r0", status="infra_error", reward=None, attempt=0)], batch="b2")
    land(cap, lake)
    rows = run_sql(lake, "select rollout_id, status, reward, attempt from rollouts order by 1").to_pylist()
    assert rows == [
        {"rollout_id": "r0", "status": "succeeded", "reward": 0.5, "attempt": 1},
        {"rollout_id": "r1", "status": "succeeded", "reward": 0.25, "attempt": 0},
    ]


def test_partitions_follow_run_and_iteration(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    frames = [fx.record(run_id=run, iteration=it, call_id=f"{run}-{it}") for run in ("a", "b") for it in (0, 1, 2)]
    fx.write_segment(cap / "p-1.seg", frames)
    land(cap, lake)
    dirs = sorted(str(p.parent.relative_to(lake)) for p in (lake / "model_calls").rglob("*.parquet"))
    assert dirs == [f"model_calls/run_id={r}/iteration={i}" for r in ("a", "b") for i in (0, 1, 2)]
    got = run_sql(lake, "select run_id, iteration, call_id from model_calls order by 1, 2").to_pylist()
    assert [(g["run_id"], g["iteration"]) for g in got] == [(r, i) for r in ("a", "b") for i in (0, 1, 2)]
    assert not list(lake.rglob(f"*{'.inprogress'}"))


def test_small_batches_commit_progressively(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    for s in range(3):
        fx.write_segment(cap / f"p-{s}.seg", [fx.record(call_id=f"{s}-{i}") for i in range(10)])
    rep = land(cap, lake, batch_bytes=4000, row_group_bytes=2000)
    assert rep.batches > 3 and rep.calls == 30
    assert len(list((lake / "_manifest").glob("batch-*.json"))) == rep.batches
    assert _count(lake) == 30 and land(cap, lake).calls == 0


def test_records_of_unexpected_shapes_are_rejected_not_fatal(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    weird = [
        capture.encode_record(
            {**fx.header(call_id="w1"), "run_id": ["a", "list"]}, b"{}", fx.response_body("chat", False)
        ),
        capture.encode_record(fx.header(call_id="w2"), b"{}", b'{"choices": [1, 2]}'),
        capture.encode_record(fx.header(call_id="w3", stream=True), b"{}", b'data: {"choices": [{"delta": 5}]}\n\n'),
        capture.encode_record({**fx.header(call_id="w4"), "run_id": "bad/run"}, b"{}", fx.response_body("chat", False)),
        capture.encode_record(fx.header(call_id="w5"), b"{}", b"[1, 2]"),
    ]
    fx.write_segment(cap / "w-1.seg", [*weird, fx.record(call_id="fine")])
    rep = land(cap, lake)
    assert (rep.calls, rep.rejects) == (1, 5)
    assert _count(lake, "select count(*) from rejects where source = 'w-1'") == 5


def test_odd_header_and_usage_types_are_coerced_or_rejected_never_fatal(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    body = json.loads(fx.response_body("chat", False))
    body["choices"][0]["finish_reason"] = 7
    body["usage"]["prompt_tokens"] = "4"
    odd = {**fx.header(call_id="odd"), "error": {"code": 1}, "model": 3, "api": "chat"}
    bad_ids = json.loads(fx.response_body("chat", False))
    bad_ids["choices"][0]["token_ids"] = ["x", "y", "z"]
    frames = [
        capture.encode_record(odd, b"{}", json.dumps(body).encode()),
        capture.encode_record(fx.header(call_id="bad-ids"), b"{}", json.dumps(bad_ids).encode()),
    ]
    fx.write_segment(cap / "o-1.seg", frames)
    rep = land(cap, lake)
    assert (rep.calls, rep.rejects) == (1, 1)
    row = run_sql(lake, "select error, model, finish_reason, prompt_tokens from model_calls").to_pylist()[0]
    assert row == {"error": '{"code":1}', "model": "3", "finish_reason": "7", "prompt_tokens": 4}
