"""The capture segment format: the contract between the proxy (writer) and the lake (reader).

A segment is a file of frames::

    b"CPR1" | u32 payload_len | u32 crc32(payload) | payload
    payload = u32 header_len | header (JSON) | u32 request_len | request bytes | response bytes

The header holds attribution and timings (see :data:`HEADER_FIELDS`); the request is the harness's
original body as sent; the response is the upstream's body as returned (raw SSE bytes for streams).
Parsing into columns happens at landing, never on the proxy's hot path.

Segments are written as ``<name>.open`` and renamed to ``<name>.seg`` when sealed. A reader takes every
complete, checksummed frame; a torn tail (crash mid-write) ends the readable part of an open segment and
is cut by :func:`recover_segment` before a writer reopens it. Rollout result rows are JSON lines in
``results-*.jsonl`` files; a torn last line is ignored by readers.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clawpipe.errors import CaptureError

MAGIC = b"CPR1"
_FRAME = struct.Struct("<4sII")
_U32 = struct.Struct("<I")
OPEN_SUFFIX = ".open"
SEALED_SUFFIX = ".seg"

# Header keys the proxy writes. Optional ones may be absent.
HEADER_FIELDS = (
    "call_id",  # str, unique per call (uuid4 hex)
    "run_id",
    "iteration",
    "rollout_id",
    "seq",  # int, arrival order within the rollout (per proxy process)
    "api",  # chat | completions | responses | messages | models
    "method",
    "path",  # path after the rollout prefix, e.g. /v1/chat/completions
    "query",
    "stream",  # bool
    "http_status",  # int, status returned to the harness
    "status",  # CallStatus
    "error",  # str | None
    "model",
    "policy_version",  # int
    "t_start",  # float epoch seconds
    "t_end",
    "upstream_ms",
    "request_changes",  # dict: fields the proxy added or changed before forwarding
    "token_source",  # upstream | retokenized | none
    "retokenized",  # optional dict {prompt_token_ids, choices: [{token_ids}]} when token_source=retokenized
    "upstream",  # replica URL used
)


@dataclass(frozen=True, slots=True)
class CaptureRecord:
    header: dict[str, Any]
    request: bytes
    response: bytes
    segment: str
    offset: int


def encode_record(header: dict[str, Any], request: bytes, response: bytes) -> bytes:
    """Frame one call. The result can be appended to a segment as is."""
    h = json.dumps(header, separators=(",", ":"), default=str).encode()
    payload = b"".join((_U32.pack(len(h)), h, _U32.pack(len(request)), request, response))
    return _FRAME.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def _decode_payload(payload: bytes) -> tuple[dict[str, Any], bytes, bytes]:
    (hlen,) = _U32.unpack_from(payload, 0)
    header = json.loads(payload[4 : 4 + hlen])
    pos = 4 + hlen
    (rlen,) = _U32.unpack_from(payload, pos)
    pos += 4
    return header, payload[pos : pos + rlen], payload[pos + rlen :]


def iter_frames(data: bytes) -> Iterator[tuple[int, bytes | None, str | None]]:
    """Yield (offset, payload, None) per intact frame, or (offset, None, reason) for a damaged one.

    Iteration stops at the first torn or damaged frame: nothing after it can be trusted to be framed.
    """
    pos, n = 0, len(data)
    while pos < n:
        if n - pos < _FRAME.size:
            yield pos, None, "torn frame header"
            return
        magic, length, crc = _FRAME.unpack_from(data, pos)
        if magic != MAGIC:
            yield pos, None, "bad frame magic"
            return
        end = pos + _FRAME.size + length
        if end > n:
            yield pos, None, "torn frame payload"
            return
        payload = data[pos + _FRAME.size : end]
        if zlib.crc32(payload) != crc:
            yield pos, None, "frame checksum mismatch"
            return
        yield pos, payload, None
        pos = end


def read_segment(path: str | os.PathLike[str]) -> Iterator[CaptureRecord | tuple[int, str]]:
    """Yield a CaptureRecord per intact frame; a damaged frame yields (offset, reason) and ends the read.

    A torn tail of an *open* segment is normal (a write in progress or a crash) and yields nothing.
    """
    p = Path(path)
    data = p.read_bytes()
    sealed = p.suffix == SEALED_SUFFIX
    for offset, payload, reason in iter_frames(data):
        if payload is None:
            if sealed or reason in ("bad frame magic", "frame checksum mismatch"):
                yield offset, reason or "damaged"
            return
        try:
            header, req, resp = _decode_payload(payload)
        except (ValueError, struct.error) as exc:
            yield offset, f"undecodable frame payload: {exc}"
            continue
        yield CaptureRecord(header, req, resp, p.name, offset)


def valid_length(data: bytes) -> int:
    """Byte length of the intact prefix of a segment."""
    end = 0
    for offset, payload, _ in iter_frames(data):
        if payload is None:
            break
        end = offset + _FRAME.size + len(payload)
    return end


def recover_segment(path: str | os.PathLike[str]) -> int:
    """Cut a torn tail off an open segment; return the number of bytes removed."""
    p = Path(path)
    data = p.read_bytes()
    keep = valid_length(data)
    if keep < len(data):
        with open(p, "r+b") as f:
            f.truncate(keep)
            os.fsync(f.fileno())
    return len(data) - keep


def seal_segment(path: str | os.PathLike[str]) -> Path:
    """Rename ``x.open`` to ``x.seg`` after cutting any torn tail."""
    p = Path(path)
    if p.suffix != OPEN_SUFFIX:
        raise CaptureError(f"{p} is not an open segment (expected suffix {OPEN_SUFFIX})")
    recover_segment(p)
    sealed = p.with_suffix(SEALED_SUFFIX)
    os.replace(p, sealed)
    return sealed


def append_result(path: str | os.PathLike[str], row: dict[str, Any]) -> None:
    """Append one rollout result row as a JSON line and fsync it (rollouts are few; safety wins)."""
    line = (json.dumps(row, separators=(",", ":"), default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_results(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """Yield (offset, row, None) per complete JSON line, (offset, None, reason) for a bad one.

    A last line without a newline is a torn write and is skipped silently.
    """
    data = Path(path).read_bytes()
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            return
        line = data[pos:nl]
        if line.strip():
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("not a JSON object")
                yield pos, row, None
            except ValueError as exc:
                yield pos, None, f"bad result line: {exc}"
        pos = nl + 1
