"""Incremental readers of the landing sources: capture segments and rollout result files, from a byte offset.

Same format and rules as :mod:`clawpipe.capture`; frames stream one at a time from where the previous
landing stopped, so memory stays flat however large a segment grows.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, cast

import msgspec
import orjson

from clawpipe import capture, schemas
from clawpipe.errors import CaptureHeaderError
from clawpipe.lake import rows

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


def decode_payload(payload: bytes, where: str = "") -> tuple[capture.CaptureHeader, memoryview, memoryview]:
    """(header, request, response) of a frame payload; raises ValueError when it is not well formed.

    The bodies are views of the payload, not copies (a large call's bodies are most of its bytes, and each
    copy of them costs fresh pages); ``where`` (the segment and the record's offset) is named in a header error.
    """
    try:
        (hlen,) = _U32.unpack_from(payload, 0)
        raw = payload[4 : 4 + hlen]
        pos = 4 + hlen
        (rlen,) = _U32.unpack_from(payload, pos)
    except struct.error as exc:
        raise ValueError(f"undecodable frame payload: {exc}") from exc
    pos += 4
    if pos + rlen > len(payload):
        raise ValueError("frame request length exceeds the payload")
    view = memoryview(payload)
    return read_header(raw, where), view[pos : pos + rlen], view[pos + rlen :]


def read_header(raw: bytes, where: str = "") -> capture.CaptureHeader:
    """The typed header of a record; a format-2 header that does not fit the struct as written is coerced."""
    try:
        return capture.decode_header(raw, where)
    except CaptureHeaderError:
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"undecodable frame payload: {exc}") from exc
        if not isinstance(obj, dict):
            raise ValueError("frame header is not a JSON object") from None
        if "format" in obj:  # a typed header: what is wrong with it is what decode_header said
            raise
        return _format2_header(obj, where)


_FORMAT2_FIELDS = frozenset(capture.CaptureHeader.__struct_fields__) - {"format"}
_CALL_STATUSES = frozenset(s.value for s in schemas.CallStatus)
_TOKEN_SOURCES = frozenset(s.value for s in schemas.TokenSource)


def _format2_header(h: dict[str, Any], where: str) -> capture.CaptureHeader:
    """A format-2 header (a plain JSON object, written before headers were typed), its values coerced the way
    landing always has: integral floats and decimal strings to numbers, anything to text in free-text
    fields. A value that does not fit raises :class:`rows.BadValue` naming the field."""
    unknown = h.keys() - _FORMAT2_FIELDS
    if unknown:
        prefix = f"{where}: " if where else ""
        raise rows.BadValue(f"{prefix}capture header field {min(unknown)} is unknown")
    iteration = rows.int_value(h.get("iteration"), "header iteration")
    if iteration is None:
        raise rows.BadValue("header iteration is missing")
    token_source = rows.one_of(h.get("token_source"), "header token_source", _TOKEN_SOURCES)
    retokenized = None
    if token_source == "retokenized" and h.get("retokenized") is not None:
        try:
            retokenized = msgspec.convert(h["retokenized"], capture.Retokenized)
        except msgspec.ValidationError as exc:
            raise rows.BadValue(f"header retokenized: {exc}") from exc
    return capture.CaptureHeader(
        format=2,
        call_id=_id(h.get("call_id"), "call_id"),
        run_id=_id(h.get("run_id"), "run_id", capture.RUN_ID_MAX),
        iteration=iteration,
        rollout_id=_id(h.get("rollout_id"), "rollout_id"),
        seq=rows.int_value(h.get("seq"), "header seq", 0, rows.INT64_MAX),
        api=rows.text(h.get("api")),
        method=rows.text(h.get("method")),
        path=rows.text(h.get("path")),
        query=rows.text(h.get("query")),
        stream=bool(rows.bool_value(h.get("stream"), "header stream")),
        http_status=rows.int_value(h.get("http_status"), "header http_status", 0, 999),
        status=cast(capture.CallStatusName | None, rows.one_of(h.get("status"), "header status", _CALL_STATUSES)),
        error=rows.text(h.get("error")),
        model=rows.text(h.get("model")),
        policy_version=rows.int_value(h.get("policy_version"), "header policy_version", 0, rows.INT64_MAX),
        t_start=rows.epoch_s(h.get("t_start"), "header t_start"),
        t_end=rows.epoch_s(h.get("t_end"), "header t_end"),
        upstream_ms=rows.float_value(h.get("upstream_ms"), "header upstream_ms"),
        request_changes=msgspec.Raw(orjson.dumps(h.get("request_changes"))),
        token_source=cast(capture.TokenSourceName | None, token_source),
        retokenized=retokenized,
        upstream=rows.text(h.get("upstream")),
    )


def _id(value: Any, what: str, max_length: int | None = None) -> str:
    if not isinstance(value, str) or not value:
        raise rows.BadValue(f"header {what} missing or not a string")
    if max_length is not None and len(value) > max_length:
        raise rows.BadValue(f"header {what} is {len(value)} characters long, longer than {max_length}")
    return value


class ResultsFile(NamedTuple):
    key: str  # its path under the captures dir, with "/"
    path: Path
    size: int  # bytes when listed


def list_results(captures_dir: Path) -> list[ResultsFile]:
    """Every results-*.jsonl under ``<captures>/results`` (symlinked folders not followed), oldest first.

    A landing run lists every results file of the run, landed or not, so the listing costs one ``stat`` per
    file and no more (``os.scandir``): each later run of a long run meets more of them."""
    found: list[tuple[int, str, str, int]] = []  # (mtime_ns, full path, key, size)
    stack = [(str(captures_dir / "results"), "results")]
    while stack:
        folder, rel = stack.pop()
        try:
            entries = os.scandir(folder)
        except (FileNotFoundError, NotADirectoryError):
            continue
        with entries:
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    stack.append((e.path, f"{rel}/{e.name}"))
                elif e.name.endswith(".jsonl"):
                    try:
                        st = e.stat()
                    except FileNotFoundError:  # removed (or a dangling link) since the folder was read
                        continue
                    if stat.S_ISREG(st.st_mode):
                        found.append((st.st_mtime_ns, e.path, f"{rel}/{e.name}", st.st_size))
    found.sort()
    return [ResultsFile(key, Path(path), size) for _, path, key, size in found]


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
