"""Capture folders for the object-store tests: one segment per rollout and the rollouts' result rows."""

from __future__ import annotations

from pathlib import Path

from tests.lake import fixtures as fx


def write_captures(tmp_path: Path, segments: int, per_segment: int) -> tuple[Path, int]:
    """``tmp_path/cap`` with ``segments`` segments of ``per_segment`` calls, one rollout each; (folder, calls)."""
    cap = tmp_path / "cap"
    for s in range(segments):
        frames = [fx.record(call_id=f"c{s}-{i}", rollout_id=f"r{s}", seq=i) for i in range(per_segment)]
        fx.write_segment(cap / f"p{s}-{s:06d}.seg", frames)
    fx.write_results(cap, [fx.rollout_row(f"r{s}") for s in range(segments)])
    return cap, segments * per_segment
