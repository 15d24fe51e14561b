"""Capture segments survive damage record by record (hypothesis): after random byte flips, cut-out ranges,
inserted garbage and truncations, every intact record lands exactly once, every damaged byte is in a
reject with its position, and recovering a dead writer's segment never removes an intact record."""

from __future__ import annotations

import shutil
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clawpipe import capture
from clawpipe.lake import land, run_sql
from tests.lake import fixtures as fx

N_RECORDS = 24


def _varied_frames() -> list[tuple[str, bytes]]:
    """(call_id, frame) of records of every API, streamed or not, of varied lengths, ids and tools."""
    out = []
    for i in range(N_RECORDS):
        api = fx.APIS[i % len(fx.APIS)]
        n = 1 + (i * 7) % 23
        c = fx.Completion(
            prompt_ids=[(i * 31 + k * 17) % 50_000 for k in range(5 + i * 11)],
            ids=[(i * 13 + k) % 32_000 for k in range(n)],
            logprobs=[-0.01 * (k + 1) for k in range(n)],
            pieces=[f"p{i}-{k} " for k in range(n)],
            tool=("lookup", {"q": "x" * i}) if i % 5 == 0 and api != "completions" else None,
            finish="tool_calls" if i % 5 == 0 and api != "completions" else "stop",
        )
        call_id = f"call-{i:03d}"
        out.append((call_id, fx.record(api, bool(i % 2), c, call_id=call_id, seq=i, rollout_id=f"r{i % 4}")))
    return out


FRAMES = _varied_frames()
DATA = b"".join(f for _, f in FRAMES)
RANGES = []  # (call_id, start, end) in the undamaged segment
_pos = 0
for _cid, _f in FRAMES:
    RANGES.append((_cid, _pos, _pos + len(_f)))
    _pos += len(_f)


@dataclass(frozen=True)
class Edit:
    kind: str  # flip | insert | cut
    pos: int  # position in the undamaged segment
    arg: int = 0  # flip: xor mask; cut: bytes removed
    garbage: bytes = b""


GHOST = fx.record(call_id="ghost")  # never whole in a segment: only its torn beginnings are inserted


def _garbage() -> st.SearchStrategy[bytes]:
    torn_copy = st.integers(1, 60).map(lambda n: GHOST[:n])  # a torn frame left mid-segment
    fake_head = st.binary(max_size=30).map(lambda b: capture.SYNC + b)  # a marker whose frame does not check
    return st.one_of(st.binary(min_size=1, max_size=80), torn_copy, fake_head)


_EDIT = st.one_of(
    st.builds(Edit, st.just("flip"), st.integers(0, len(DATA) - 1), st.integers(1, 255)),
    st.builds(Edit, st.just("insert"), st.integers(0, len(DATA)), st.just(0), _garbage()),
    st.builds(Edit, st.just("cut"), st.integers(0, len(DATA) - 1), st.integers(1, 300)),
)


def _apply(edits: list[Edit], truncate_at: int | None) -> tuple[bytes, set[str]]:
    """The damaged segment and the call ids of the records still whole in it."""
    data = bytearray(DATA)
    removed = bytearray(len(DATA))  # 1 where an original byte was cut away
    inserts: dict[int, bytes] = {}
    for e in edits:
        if e.kind == "flip":
            data[e.pos] ^= e.arg
        elif e.kind == "cut":
            end = min(len(DATA), e.pos + e.arg)
            removed[e.pos : end] = b"\1" * (end - e.pos)
        else:
            inserts[e.pos] = inserts.get(e.pos, b"") + e.garbage
    out = bytearray()
    for i in range(len(DATA) + 1):
        if truncate_at is not None and i >= truncate_at:
            break
        out += inserts.get(i, b"")
        if i < len(DATA) and not removed[i]:
            out.append(data[i])
    # whole = its frame's bytes are still there, in one piece (a cut may slide along equal bytes, so
    # which record an edit "touched" is not always unique; the bytes are)
    whole = {cid for cid, frame in FRAMES if frame in out}
    untouched = {
        cid
        for cid, s, e in RANGES
        if data[s:e] == DATA[s:e]
        and not any(removed[s:e])
        and not any(s < i < e for i in inserts)
        and (truncate_at is None or truncate_at >= e)
    }
    assert untouched <= whole
    return bytes(out), whole


def _check_scan_partitions_the_segment(data: bytes, intact: set[str]) -> list[int]:
    """Intact frames and damaged regions tile the sealed segment; returns the damage offsets."""
    pos, damage, seen = 0, [], []
    for item in capture.scan_frames(capture.BytesSource(data), final=True):
        assert item.offset == pos, "frames and damaged regions leave no gap and do not overlap"
        if isinstance(item, capture.Damage):
            assert item.end > item.offset
            damage.append(item.offset)
        else:
            seen.append(capture.decode_payload(item.payload)[0]["call_id"])
        pos = item.end
    assert pos == len(data)
    assert sorted(seen) == sorted(intact), "exactly the intact records, each once"
    return damage


@settings(max_examples=150, deadline=None)
@given(edits=st.lists(_EDIT, min_size=1, max_size=6), truncate=st.one_of(st.none(), st.integers(0, len(DATA))))
def test_scan_finds_every_intact_record_after_random_damage(edits: list[Edit], truncate: int | None) -> None:
    data, intact = _apply(edits, truncate)
    _check_scan_partitions_the_segment(data, intact)


def _landed(lake: Path) -> tuple[list[str], list[tuple[str, int]]]:
    calls = [
        cid
        for p in sorted((lake / "model_calls").rglob("*.parquet"))
        for cid in pq.read_table(p, columns=["call_id"]).column(0).to_pylist()
    ]
    rejects = [
        (r["source"], r["offset"])
        for p in sorted((lake / "rejects").rglob("*.parquet"))
        for r in pq.read_table(p, columns=["source", "offset"]).to_pylist()
    ]
    return calls, rejects


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(_EDIT, min_size=1, max_size=5), truncate=st.one_of(st.none(), st.integers(0, len(DATA))))
def test_landing_and_recovery_keep_every_intact_record(tmp_path: Path, edits: list[Edit], truncate: int | None) -> None:
    data, intact = _apply(edits, truncate)
    work = tmp_path / "w"
    shutil.rmtree(work, ignore_errors=True)
    cap, lake = work / "cap", work / "lake"
    seg = fx.write_segment(cap / "p-000001.open", [data])
    # an open segment: whatever is intact lands now; damage with an intact frame after it is a reject
    first = land(cap, lake)
    # the writer died: recovery cuts at most a torn tail after the last intact record
    capture.recover_segment(seg)
    kept = seg.read_bytes()
    assert data.startswith(kept)
    last_intact_end = max(
        (
            item.end
            for item in capture.scan_frames(capture.BytesSource(data), final=True)
            if isinstance(item, capture.Frame)
        ),
        default=0,
    )
    assert len(kept) >= last_intact_end
    capture.seal_segment(seg)
    second = land(cap, lake)
    damage = _check_scan_partitions_the_segment(kept, intact)
    calls, rejects = _landed(lake)
    assert sorted(calls) == sorted(intact), "every intact record lands exactly once"
    assert first.calls + second.calls == len(intact)
    assert sorted(rejects) == [("p-000001", off) for off in damage], "each damaged region is one reject, where it is"


def test_landing_goes_on_after_a_flipped_byte(tmp_path: Path) -> None:
    """One flipped byte in the head of record 10 of 400: 399 land, 1 reject, nothing silently missing."""
    frames = [fx.record(call_id=f"c{i}", seq=i) for i in range(400)]
    damaged = bytearray(frames[10])
    damaged[9] ^= 0x40  # the length field: the head checksum catches it before the length is trusted
    fx.write_segment(tmp_path / "cap" / "s-1.seg", [*frames[:10], bytes(damaged), *frames[11:]])
    rep = land(tmp_path / "cap", tmp_path / "lake")
    assert (rep.calls, rep.rejects) == (399, 1)
    rows = run_sql(tmp_path / "lake", 'select "offset", reason from rejects').to_pylist()
    assert rows[0]["offset"] == sum(map(len, frames[:10]))
    assert "head checksum" in rows[0]["reason"] and f"{len(frames[10])} bytes" in rows[0]["reason"]


def _legacy_frame(call_id: str) -> bytes:
    """A format-1 frame as segments written before format 2 hold them: b"CPR1" | len | crc | payload."""
    frame = fx.record(call_id=call_id)
    payload = frame[capture.HEAD_SIZE :]
    return struct.pack("<4sII", b"CPR1", len(payload), zlib.crc32(payload)) + payload


def test_legacy_segments_still_land_and_resynchronise(tmp_path: Path) -> None:
    frames = [_legacy_frame(f"old{i}") for i in range(6)]
    bad = bytearray(frames[2])
    bad[40] ^= 1
    fx.write_segment(tmp_path / "cap" / "old-1.seg", [*frames[:2], bytes(bad), *frames[3:]])
    rep = land(tmp_path / "cap", tmp_path / "lake")
    assert (rep.calls, rep.rejects) == (5, 1)
    got = run_sql(tmp_path / "lake", "select call_id from model_calls order by call_id").column(0).to_pylist()
    assert got == ["old0", "old1", "old3", "old4", "old5"]


def test_recovery_keeps_damage_in_the_middle_and_cuts_only_a_torn_tail(tmp_path: Path) -> None:
    frames = [fx.record(call_id=f"c{i}") for i in range(5)]
    bad = bytearray(frames[1])
    bad[3] ^= 0xFF  # the sync marker: the frame is found by nothing but its neighbours
    torn = fx.record(call_id="torn")[:-7]
    seg = fx.write_segment(tmp_path / "p-1.open", [frames[0], bytes(bad), *frames[2:], torn])
    assert capture.recover_segment(seg) == len(torn)
    assert [r.header["call_id"] for r in capture.read_segment(seg) if isinstance(r, capture.CaptureRecord)] == [
        "c0",
        "c2",
        "c3",
        "c4",
    ]
    # damage after the last intact record that is not a torn write stays for landing to report
    tail = bytearray(frames[4])
    tail[-1] ^= 1
    seg2 = fx.write_segment(tmp_path / "p-2.open", [*frames[:4], bytes(tail)])
    assert capture.recover_segment(seg2) == 0
    sealed = capture.seal_segment(seg2)
    assert list(capture.read_segment(sealed))[-1] == (sum(map(len, frames[:4])), "frame checksum mismatch")
