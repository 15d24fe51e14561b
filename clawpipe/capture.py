"""The capture segment format: the contract between the proxy (writer) and the lake (reader).

A segment is a file of frames (format 2)::

    SYNC (8 bytes) | u32 payload_len | u32 crc32(payload) | u32 crc32(the 16 bytes before) | payload
    payload = u32 header_len | header (JSON) | u32 request_len | request bytes | response bytes

The header holds attribution and timings (see :data:`HEADER_FIELDS`); the request is the harness's
original body as sent; the response is the upstream's body as returned (raw SSE bytes for streams).
Parsing into columns happens at landing, never on the proxy's hot path.

Damage stays local. The head checksum covers the length and the payload checksum, so a damaged length is
caught before it is trusted; the payload checksum covers the rest. After a damaged frame a reader scans
forward for the next ``SYNC`` whose frame checks out (:func:`scan_frames`): one damaged region costs the
records in it, never the ones after it. Bytes inside a record are searched for frames only when that
record is damaged; ``SYNC`` holds bytes that valid UTF-8 (so any JSON body) cannot contain.
Segments written before format 2 (``CPR1`` frames: magic, length, payload checksum) are still read, with
the same resynchronisation on their magic.

Segments are written as ``<name>.open`` and renamed to ``<name>.seg`` when sealed. A torn tail (a crash
mid-write: an incomplete frame after the last intact one) is a write in progress to readers of an open
segment and is cut by :func:`recover_segment` before a dead writer's segment is sealed; nothing before
the last intact frame is ever removed. Rollout result rows are JSON lines in ``results-*.jsonl`` files;
a torn last line is ignored by readers.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from clawpipe.errors import CaptureError

SYNC = b"\xa9CPR2\x00\x5a\xe1"  # not UTF-8 (0xa9 cannot start a character): rare in captured text
LEGACY_MAGIC = b"CPR1"
_HEAD = struct.Struct("<8sIII")  # sync, payload length, payload crc, head crc
_HEAD_CRC_SPAN = 16  # the head checksum covers sync, length and payload crc
HEAD_SIZE = _HEAD.size
_LEGACY_HEAD = struct.Struct("<4sII")  # magic, payload length, payload crc
_U32 = struct.Struct("<I")
_FIND_CHUNK = 1 << 20
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


@dataclass(slots=True)  # not frozen: a frozen dataclass costs a setattr call per field, per frame
class Frame:
    """An intact frame: its byte range in the segment and its payload."""

    offset: int
    end: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class Damage:
    """A damaged region ``[offset, end)``: what lies between two intact frames (or before the end)."""

    offset: int
    end: int
    reason: str


def encode_record(header: dict[str, Any], request: bytes, response: bytes) -> bytes:
    """Frame one call. The result can be appended to a segment as is."""
    h = json.dumps(header, separators=(",", ":"), default=str).encode()
    payload = b"".join((_U32.pack(len(h)), h, _U32.pack(len(request)), request, response))
    head = SYNC + struct.pack("<II", len(payload), zlib.crc32(payload))
    return head + _U32.pack(zlib.crc32(head)) + payload


def decode_payload(payload: bytes) -> tuple[dict[str, Any], bytes, bytes]:
    """(header, request, response) of a frame payload; raises ValueError when it is not well formed."""
    try:
        (hlen,) = _U32.unpack_from(payload, 0)
        header = json.loads(payload[4 : 4 + hlen])
        pos = 4 + hlen
        (rlen,) = _U32.unpack_from(payload, pos)
    except (struct.error, ValueError) as exc:
        raise ValueError(f"undecodable frame payload: {exc}") from exc
    if not isinstance(header, dict):
        raise ValueError("frame header is not a JSON object")
    pos += 4
    if pos + rlen > len(payload):
        raise ValueError("frame request length exceeds the payload")
    return header, payload[pos : pos + rlen], payload[pos + rlen :]


# -- reading frames from any source ----------------------------------------------------------------------


class Source(Protocol):
    """Random access to a segment's first ``size`` bytes (later growth of an open segment is not seen)."""

    size: int

    def read(self, pos: int, n: int) -> bytes: ...

    def find(self, needle: bytes, pos: int) -> int: ...


class BytesSource:
    """A segment held in memory."""

    def __init__(self, data: bytes) -> None:
        self.data, self.size = data, len(data)

    def read(self, pos: int, n: int) -> bytes:
        return self.data[pos : pos + n]

    def find(self, needle: bytes, pos: int) -> int:
        return self.data.find(needle, pos)


class FileSource:
    """A segment read through a buffered file, up to its size when opened: memory stays flat."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.size = os.fstat(f.fileno()).st_size
        self._pos = -1  # where the file is positioned; sequential reads skip the seek

    def read(self, pos: int, n: int) -> bytes:
        if pos + n > self.size:
            n = self.size - pos
            if n <= 0:
                return b""
        if pos != self._pos:
            self.f.seek(pos)
        data = self.f.read(n)
        self._pos = pos + len(data)
        return data

    def find(self, needle: bytes, pos: int) -> int:
        overlap = len(needle) - 1
        while pos < self.size:
            chunk = self.read(pos, _FIND_CHUNK)
            i = chunk.find(needle)
            if i >= 0:
                return pos + i
            if pos + len(chunk) >= self.size:
                return -1
            pos += len(chunk) - overlap
        return -1


@dataclass(frozen=True, slots=True)
class _Bad:
    reason: str
    end: int | None = None  # where the frame ends, when its verified head says so (its payload is damaged)
    torn: bool = False  # an incomplete frame at the end of the source: what a write in progress looks like


_TORN_HEAD = _Bad("torn frame head", torn=True)
_NO_MARKER = _Bad("no frame marker")


def _frame_at(src: Source, pos: int, legacy: bool) -> Frame | _Bad:
    """The frame starting at ``pos`` if it is intact, else why not."""
    if legacy:
        return _legacy_frame_at(src, pos)
    head = src.read(pos, HEAD_SIZE)
    if len(head) < HEAD_SIZE:
        return _TORN_HEAD if SYNC.startswith(head[: len(SYNC)]) else _NO_MARKER
    sync, length, pcrc, hcrc = _HEAD.unpack(head)
    if sync != SYNC:
        return _NO_MARKER
    if zlib.crc32(head[:_HEAD_CRC_SPAN]) != hcrc:
        return _Bad("frame head checksum mismatch")
    start = pos + HEAD_SIZE
    end = start + length
    if end > src.size:
        return _Bad("torn frame payload", torn=True)
    payload = src.read(start, length)
    if zlib.crc32(payload) != pcrc:
        return _Bad("frame checksum mismatch", end=end)
    return Frame(pos, end, payload)


def _legacy_frame_at(src: Source, pos: int) -> Frame | _Bad:
    head = src.read(pos, _LEGACY_HEAD.size)
    if len(head) < _LEGACY_HEAD.size:
        return _TORN_HEAD if LEGACY_MAGIC.startswith(head[:4]) else _NO_MARKER
    magic, length, crc = _LEGACY_HEAD.unpack(head)
    if magic != LEGACY_MAGIC:
        return _NO_MARKER
    end = pos + _LEGACY_HEAD.size + length
    if end > src.size:
        return _Bad("torn frame payload", torn=True)
    payload = src.read(pos + _LEGACY_HEAD.size, length)
    if zlib.crc32(payload) != crc:
        return _Bad("frame checksum mismatch")  # the length is unchecked in this format: no end to trust
    return Frame(pos, end, payload)


def is_legacy(src: Source) -> bool:
    """Whether the segment holds format-1 (``CPR1``) frames."""
    head = src.read(0, len(SYNC))
    if head == SYNC:
        return False
    if head[:4] == LEGACY_MAGIC:
        return True
    return src.find(SYNC, 0) < 0 and src.find(LEGACY_MAGIC, 0) >= 0


def _resync(src: Source, pos: int, legacy: bool) -> Frame | None:
    """The first intact frame after the damaged one at ``pos``, or None.

    Every marker after ``pos`` is a candidate, also those inside the damaged frame's claimed extent: a
    frame torn mid-segment may claim bytes that hold intact frames, and those must not be skipped.
    """
    marker = LEGACY_MAGIC if legacy else SYNC
    p = pos + 1
    while True:
        i = src.find(marker, p)
        if i < 0:
            return None
        got = _frame_at(src, i, legacy)
        if isinstance(got, Frame):
            return got
        p = i + 1


def scan_frames(src: Source, start: int = 0, *, final: bool) -> Iterator[Frame | Damage]:
    """Every intact frame from ``start`` and every damaged region between them, in order.

    A damaged region ends where the next intact frame starts. Damage after the last intact frame is yielded
    only when ``final`` (a sealed segment): in an open one it may be a write in progress, and the read stops
    before it.
    """
    legacy = is_legacy(src)
    size = src.size
    pos = start
    read, unpack, crc32 = src.read, _HEAD.unpack, zlib.crc32
    while pos < size:
        if not legacy:  # the intact frame, inlined: this loop runs once per captured call
            head = read(pos, HEAD_SIZE)
            if len(head) == HEAD_SIZE:
                sync, length, pcrc, hcrc = unpack(head)
                end = pos + HEAD_SIZE + length
                if sync == SYNC and crc32(head[:_HEAD_CRC_SPAN]) == hcrc and end <= size:
                    payload = read(pos + HEAD_SIZE, length)
                    if crc32(payload) == pcrc:
                        yield Frame(pos, end, payload)
                        pos = end
                        continue
        got = _frame_at(src, pos, legacy)
        if isinstance(got, Frame):
            yield got
            pos = got.end
            continue
        reason = got.reason
        nxt = _resync(src, pos, legacy)
        if nxt is None:
            if final:
                yield Damage(pos, size, reason)
            return
        yield Damage(pos, nxt.offset, reason)
        yield nxt
        pos = nxt.end


def read_segment(path: str | os.PathLike[str]) -> Iterator[CaptureRecord | tuple[int, str]]:
    """Yield a CaptureRecord per intact frame and ``(offset, reason)`` per damaged region, in order.

    Damage after the last intact frame of an *open* segment is a write in progress (or a crash) and yields
    nothing; in a sealed segment it is damage like any other.
    """
    p = Path(path)
    with open(p, "rb") as f:
        for item in scan_frames(FileSource(f), final=p.suffix == SEALED_SUFFIX):
            if isinstance(item, Damage):
                yield item.offset, item.reason
                continue
            try:
                header, req, resp = decode_payload(item.payload)
            except ValueError as exc:
                yield item.offset, str(exc)
                continue
            yield CaptureRecord(header, req, resp, p.name, item.offset)


def torn_tail_start(src: Source) -> int:
    """Where a torn tail begins (``src.size`` when there is none).

    A torn tail is an incomplete frame after the last intact one, possibly behind damaged frames whose
    verified heads give their ends. Anything else after the last intact frame is damage, kept for landing
    to report.
    """
    legacy = is_legacy(src)
    last = 0
    for item in scan_frames(src, final=False):
        if isinstance(item, Frame):
            last = item.end
    pos = last
    while pos < src.size:
        got = _frame_at(src, pos, legacy)
        if isinstance(got, Frame):
            return src.size
        if got.torn:
            return pos
        if got.end is None:
            return src.size  # damage of unknown extent: kept whole
        pos = got.end  # a damaged frame whose verified head gives its end: what follows may be torn
    return src.size


def recover_segment(path: str | os.PathLike[str]) -> int:
    """Cut a torn tail off an open segment; return the number of bytes removed.

    Only an incomplete frame after the last intact one is cut; damaged frames stay (landing reports them).
    """
    p = Path(path)
    with open(p, "rb") as f:
        src = FileSource(f)
        keep, size = torn_tail_start(src), src.size
    if keep < size:
        with open(p, "r+b") as f:
            f.truncate(keep)
            os.fsync(f.fileno())
    return size - keep


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
