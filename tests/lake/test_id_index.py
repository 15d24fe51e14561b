"""Landing checks committed calls through the per-part id sidecars: no run reads what is already landed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from clawpipe.lake import compact, id_index, land, run_sql
from clawpipe.tables import LakeFS
from tests.lake import fixtures as fx

ROOT = Path(__file__).resolve().parents[2]
PART_DIR = ("model_calls", "run_id=run1", "iteration=0")


def _count(lake: Path) -> int:
    return run_sql(lake, "select count(*) from model_calls").column(0)[0].as_py()


def _segment(cap: Path, name: str, ids: list[str]) -> None:
    fx.write_segment(cap / f"{name}.seg", [fx.record(call_id=c) for c in ids])


def test_every_part_has_a_sidecar_of_its_call_ids(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    _segment(cap, "a", [f"a{i}" for i in range(5)])
    land(cap, lake)
    _segment(cap, "b", [f"b{i}" for i in range(3)])
    land(cap, lake)
    parts = sorted(lake.joinpath(*PART_DIR).glob("*.parquet"))
    assert len(parts) == 2
    for part in parts:
        side = np.fromfile(part.with_suffix(id_index.SUFFIX), dtype="<u8")
        assert side.size and np.all(side[1:] > side[:-1]), "sorted and distinct"
    got = {int(h) for p in parts for h in np.fromfile(p.with_suffix(id_index.SUFFIX), dtype="<u8")}
    want = {int(h) for h in id_index.hash_ids([f"a{i}" for i in range(5)] + [f"b{i}" for i in range(3)])}
    assert got == want


def test_a_run_reads_no_committed_part_without_a_duplicate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    for r in range(3):
        _segment(cap, f"s{r}", [f"s{r}-{i}" for i in range(4)])
        land(cap, lake)
    reads: list[str] = []
    real = LakeFS.read_parquet

    def counting(self: LakeFS, rel: str, columns: list[str] | None = None):  # type: ignore[no-untyped-def]
        reads.append(rel)
        return real(self, rel, columns)

    monkeypatch.setattr(LakeFS, "read_parquet", counting)
    _segment(cap, "new", ["n0", "n1"])
    assert land(cap, lake).calls == 2
    assert [r for r in reads if r.startswith("model_calls/")] == []  # the old code read every part's call_id
    _segment(cap, "dup", ["s1-2", "n2"])
    rep = land(cap, lake)
    assert (rep.calls, rep.duplicates) == (1, 1)
    assert len([r for r in reads if r.startswith("model_calls/")]) == 1  # only the part holding the duplicate
    assert _count(lake) == 15


def test_a_hash_collision_never_drops_a_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    monkeypatch.setattr(id_index, "hash_ids", lambda ids: np.zeros(len(list(ids)), dtype="<u8"))
    _segment(cap, "a", ["a0", "a1"])
    land(cap, lake)
    _segment(cap, "b", ["b0", "a1"])  # b0 hashes like every landed call
    rep = land(cap, lake)
    assert (rep.calls, rep.duplicates) == (1, 1)
    assert _count(lake) == 3


def test_parts_without_a_sidecar_get_one_and_still_dedup(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    for r in range(2):
        _segment(cap, f"s{r}", [f"s{r}-{i}" for i in range(3)])
        land(cap, lake)
    compact(lake)  # the compacted part has no sidecar; an older lake's parts neither
    part_dir = lake.joinpath(*PART_DIR)
    assert not list(part_dir.glob("*" + id_index.SUFFIX))
    _segment(cap, "late", ["s0-1", "late"])
    rep = land(cap, lake)
    assert (rep.calls, rep.duplicates) == (1, 1)
    parts = list(part_dir.glob("*.parquet"))
    assert all(p.with_suffix(id_index.SUFFIX).exists() for p in parts)
    assert _count(lake) == 7


@pytest.mark.slow
def test_killed_before_commit_leaves_no_sidecar_behind(tmp_path: Path) -> None:
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    for s in range(4):
        _segment(cap, f"proxy-{s}", [f"s{s}-c{i}" for i in range(8)])
    code = "import sys; from clawpipe.lake import land; land(sys.argv[1], sys.argv[2], batch_bytes=6000)"
    env = {**os.environ, "CLAWPIPE_LAKE_CRASH_BEFORE_COMMIT": "2"}
    proc = subprocess.run([sys.executable, "-c", code, str(cap), str(lake)], cwd=ROOT, env=env, check=False)
    assert proc.returncode == -signal.SIGKILL
    part_dir = lake.joinpath(*PART_DIR)
    assert len(list(part_dir.glob("*" + id_index.SUFFIX))) == 2  # the dead batch's sidecar is on disk
    land(cap, lake)
    parts = {p.stem for p in part_dir.glob("*.parquet")}
    sides = {p.stem for p in part_dir.glob("*" + id_index.SUFFIX)}
    assert parts == sides  # the rolled-back part took its sidecar with it
    got = run_sql(lake, "select count(*) as n, count(distinct call_id) as d from model_calls").to_pylist()[0]
    assert got == {"n": 32, "d": 32}
