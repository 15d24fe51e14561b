"""Incremental readers of the landing sources: capture segments and rollout result files, from a byte offset.

Same format and rules as :mod:`clawpipe.capture`; frames stream one at a time from where the previous
landing stopped, so memory stays flat however large a segment grows.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from clawpipe import capture

_U32 = struct.Struct("<I")
_READ_BUFFER = 1 << 20

Frame = capture.Frame
Damage = capture.Damage


@dataclass(frozen=True, slots=True)
class Segment:
    key: str  # path relative to the captures dir, without the .open/.seg suffix
    path: Path
    sealed: bool


def list_segments(captures_dir: Path) -> list[Segment]:
    """Segments under the captures dir (any depth, results/ excluded); a sealed one wins over an open twin."""
    found: dict[str, Segment] = {}
    if not captures_dir.is_dir():
        return []
    for dirpath, dirs, files in os.walk(captures_dir):
        rel_dir = os.path.relpath(dirpath, captures_dir)
        if rel_dir == ".":
            dirs[:] = [d for d in dirs if d != "results"]
            rel_dir = ""
        for name in files:
            if name.endswith(capture.SEALED_SUFFIX):
                stem, sealed = name[: -len(capture.SEALED_SUFFIX)], True
            elif name.endswith(capture.OPEN_SUFFIX):
                stem, sealed = name[: -len(capture.OPEN_SUFFIX)], False
            else:
                continue
            key = f"{rel_dir}/{stem}" if rel_dir else stem
            if sealed or key not in found:
                found[key] = Segment(key, Path(dirpath) / name, sealed)
    return [found[k] for k in sorted(found)]


def open_segment(seg: Segment) -> tuple[Any, bool]:
    """Open a segment's file; an open segment sealed meanwhile is found under its new name."""
    try:
        return open(seg.path, "rb", buffering=_READ_BUFFER), seg.sealed
    except FileNotFoundError:
        if seg.sealed:
            raise
        sealed = seg.path.with_suffix(capture.SEALED_SUFFIX)
        return open(sealed, "rb", buffering=_READ_BUFFER), True


def read_frames(f: Any, start: int, *, sealed: bool) -> Iterator[Frame | Damage]:
    """Intact frames from ``start`` and the damaged regions between them (:func:`clawpipe.capture.scan_frames`).

    Damage after the last intact frame is yielded only for a sealed segment; in an open one it may be a
    write in progress, and the read stops before it (the next landing looks again).
    """
    return capture.scan_frames(capture.FileSource(f), start, final=sealed)


def decode_payload(payload: bytes) -> tuple[dict[str, Any], bytes, bytes]:
    """(header, request, response) of a frame payload; raises ValueError when it is not well formed."""
    try:
        (hlen,) = _U32.unpack_from(payload, 0)
        header = orjson.loads(payload[4 : 4 + hlen])
        pos = 4 + hlen
        (rlen,) = _U32.unpack_from(payload, pos)
    except (struct.error, orjson.JSONDecodeError) as exc:
        raise ValueError(f"undecodable frame payload: {exc}") from exc
    if not isinstance(header, dict):
        raise ValueError("frame header is not a JSON object")
    pos += 4
    if pos + rlen > len(payload):
        raise ValueError("frame request length exceeds the payload")
    return header, payload[pos : pos + rlen], payload[pos + rlen :]


def list_results(captures_dir: Path) -> list[tuple[str, Path]]:
    """(key, path) of every results-*.jsonl under ``<captures>/results``, oldest first."""
    root = captures_dir / "results"
    if not root.is_dir():
        return []
    files = [p for p in root.rglob("*.jsonl") if p.is_file()]
    files.sort(key=lambda p: (p.stat().st_mtime_ns, str(p)))
    return [(str(p.relative_to(captures_dir)), p) for p in files]


def read_result_lines(path: Path, start: int) -> tuple[list[tuple[int, dict[str, Any] | None, str | None]], int]:
    """Complete lines from ``start``: ([(offset, row, None) | (offset, None, reason)], end of the last one)."""
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read()
    out: list[tuple[int, dict[str, Any] | None, str | None]] = []
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break  # torn last line: a write in progress
        line = data[pos:nl]
        if line.strip():
            try:
                row = orjson.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("not a JSON object")
                out.append((start + pos, row, None))
            except ValueError as exc:
                out.append((start + pos, None, f"bad result line: {exc}"))
        pos = nl + 1
    return out, start + pos
