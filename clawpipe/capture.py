"""The capture segment format: the contract between the proxy (writer) and the lake (reader).

A segment is a file of frames (format 2)::

    SYNC (8 bytes) | u32 payload_len | u32 crc32(payload) | u32 crc32(the 16 bytes before) | payload
    payload = u32 header_len | header (JSON) | u32 request_len | request bytes | response bytes

The header is a :class:`CaptureHeader` (attribution, timings, outcome), written as a JSON object that
names its format (``"format": 3``); the request is the harness's original body as sent; the response is
the upstream's body as returned (raw SSE bytes for streams). Parsing into columns happens at landing,
never on the proxy's hot path. Readers decode the header into the struct (:func:`decode_header`): a field
of the wrong type, a missing required field or an unknown field is an error naming that field. Headers
written by earlier proxies are plain JSON objects without ``format`` (format 2) holding the same fields;
those that fit the struct decode as they are, and landing coerces the rest the way it always has.

Damage stays local. The head checksum covers the length and the payload checksum, so a damaged length is
caught before it is trusted; the payload checksum covers the rest. After a damaged frame a reader scans
forward for the next ``SYNC`` whose frame checks out (:func:`scan_frames`): one damaged region costs the
records in it, never the ones after it. Bytes inside a record are searched for frames only when that
record is damaged; ``SYNC`` holds bytes that valid UTF-8 (so any JSON body) cannot contain.
Segments written before format 2 (``CPR1`` frames: magic, length, payload checksum) are still read, with
the same resynchronisation on their magic. A segment whose first marker names a later framing (``CPR3`` on,
:func:`later_framing`) is not damage: landing holds it back unlanded for the version that reads it.

Segments are written as ``<name>.open`` and renamed to ``<name>.seg`` when sealed. A torn tail (a crash
mid-write: an incomplete frame after the last intact one) is a write in progress to readers of an open
segment and is cut by :func:`recover_segment` before a dead writer's segment is sealed; nothing before
the last intact frame is ever removed. Rollout result rows are JSON lines in ``results-*.jsonl`` files;
a torn last line is ignored by readers.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import struct
import sys
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, BinaryIO, Literal, Protocol

import msgspec

from clawpipe.errors import CaptureError, CaptureHeaderError

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

HEADER_FORMAT = 3  # the format a typed header names; a header without one was written as a format-2 dict
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
EPOCH_MAX_S = 253_402_300_800.0  # 10000-01-01: the last second a timestamp column holds

RUN_ID_MAX = 200  # a run id names a lake partition directory (run_id=<id>): file names stop at 255 bytes
SAFE_RUN_ID = r"^[A-Za-z0-9][A-Za-z0-9._:@+-]*$"  # no path separator, no leading dot: a partition name
Id = Annotated[str, msgspec.Meta(min_length=1)]
RunId = Annotated[str, msgspec.Meta(min_length=1, max_length=RUN_ID_MAX)]
Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
Epoch = Annotated[float, msgspec.Meta(ge=0.0, lt=EPOCH_MAX_S)]
CallStatusName = Literal["ok", "http_error", "upstream_error", "cancelled"]  # schemas.CallStatus
TokenSourceName = Literal["upstream", "retokenized", "none"]  # schemas.TokenSource
NO_CHANGES = msgspec.Raw(b"{}")


class RetokenizedChoice(msgspec.Struct, forbid_unknown_fields=True):
    token_ids: list[int]


class Retokenized(msgspec.Struct, forbid_unknown_fields=True):
    """Ids the proxy encoded itself, for a call whose upstream returned none (``token_source=retokenized``)."""

    prompt_token_ids: list[int]
    choices: list[RetokenizedChoice]


class CaptureHeader(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One call's attribution, timings and outcome: what the proxy records beside the request and response.

    The proxy builds it when a call arrives and fills in the outcome fields as the call ends; landing maps
    it onto the ``model_calls`` columns of the same names. Optional fields are None where a call never got
    that far (no upstream picked, no answer) or where a format-2 header did not say.
    """

    # the proxy writes HEADER_FORMAT; a decoded header without the key is format 2; a later format is refused
    format: Annotated[int, msgspec.Meta(ge=2, le=HEADER_FORMAT)] = 2
    call_id: Id  # unique per call (random hex)
    run_id: RunId
    iteration: Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
    rollout_id: Id
    seq: Count | None = None  # arrival order within the rollout (per proxy process)
    api: str | None = None  # chat | completions | responses | messages | models | unknown
    method: str | None = None
    path: str | None = None  # path after the rollout prefix, e.g. /v1/chat/completions
    query: str | None = None
    stream: bool = False
    http_status: Annotated[int, msgspec.Meta(ge=0, le=999)] | None = None  # status returned to the harness
    status: CallStatusName | None = None
    error: str | None = None
    model: str | None = None
    policy_version: Count | None = None  # the weights version the proxy stamped
    t_start: Epoch | None = None  # epoch seconds
    t_end: Epoch | None = None
    upstream_ms: Annotated[float, msgspec.Meta(ge=0.0, le=sys.float_info.max)] | None = None  # finite
    request_changes: msgspec.Raw = NO_CHANGES  # JSON: fields the proxy added or changed before forwarding
    token_source: TokenSourceName | None = None  # upstream | retokenized | none (None: landing decides)
    retokenized: Retokenized | None = None  # set when token_source is retokenized
    upstream: str | None = None  # replica URL used
    response_partial: int | None = None  # bytes the upstream had sent when the recorded body replaces them


# The header's fields about its call: all but the format and the byte count of a replaced response.
HEADER_FIELDS = tuple(f for f in CaptureHeader.__struct_fields__ if f not in ("format", "response_partial"))
_HEADER_DECODER = msgspec.json.Decoder(CaptureHeader)
_ENCODER = msgspec.json.Encoder()


def decode_header(raw: bytes, where: str = "") -> CaptureHeader:
    """The typed header in ``raw`` (a JSON object); ``where`` (e.g. the segment and offset) prefixes errors.

    Raises :class:`CaptureHeaderError` naming the field that is missing, unknown or of the wrong type.
    """
    try:
        return _HEADER_DECODER.decode(raw)
    except msgspec.ValidationError as exc:
        raise CaptureHeaderError(_header_problem(str(exc), where)) from exc
    except msgspec.DecodeError as exc:
        raise CaptureHeaderError(f"{where}: capture header is not JSON: {exc}" if where else str(exc)) from exc


def later_framing(head: bytes) -> str | None:
    """The frame marker a segment starting with ``head`` (its first 8 bytes) was written in, where that is a later
    framing than this reader's (``CPR3`` and on, after the same first byte), else None: such a segment is held
    back unlanded, not read as damage."""
    if len(head) >= 5 and head[:4] == SYNC[:4] and head[4:5].isdigit() and head[4:5] > SYNC[4:5]:
        return head[1:5].decode()
    return None


def _header_problem(msg: str, where: str) -> str:
    """msgspec's validation message, said as which header field is wrong and what to do."""
    prefix = f"{where}: " if where else ""
    if msg.startswith("Object missing required field `"):
        field = msg.split("`")[1]
        return f"{prefix}capture header field {field} is missing (every record names its call, run, iteration, rollout)"
    if msg.startswith("Object contains unknown field `"):
        field = msg.split("`")[1]
        return (
            f"{prefix}capture header field {field} is unknown (a header holds the fields of "
            "clawpipe.capture.CaptureHeader); land it with the clawpipe version that wrote it"
        )
    if " - at `$." in msg:
        what, at = msg.split(" - at `$.", 1)
        field = at.rstrip("`")
        if field == "format":
            what += (
                f" (this clawpipe reads header formats 2 to {HEADER_FORMAT}; land it with the version that wrote it)"
            )
        return f"{prefix}capture header field {field}: {what}"
    return f"{prefix}capture header: {msg}"


@dataclass(frozen=True, slots=True)
class CaptureRecord:
    header: dict[str, Any]  # as written (JSON object); decode_header gives the typed CaptureHeader
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


def encode_record(header: CaptureHeader | Mapping[str, Any], request: bytes, response: bytes) -> bytes:
    """Frame one call. The result can be appended to a segment as is.

    A :class:`CaptureHeader` is written typed (it names its format); a mapping is written as given, the way
    format-2 proxies wrote their headers (tests use it for old and hostile records).
    """
    if isinstance(header, CaptureHeader):
        h = _ENCODER.encode(header)
    else:
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


def write_failure(exc: OSError, path: str | os.PathLike[str]) -> str:
    """A failed write said for a person: the error, and for a full disk or too many open files the space
    left on ``path``'s filesystem or the process's descriptor limit, with what to do."""
    what = f"{exc.strerror or exc}" + (f" (errno {exc.errno})" if exc.errno else "")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            st = os.statvfs(path)
            free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
            what += f": {free} of {total} bytes free on the filesystem of {path}"
            if st.f_files and not st.f_favail:
                what += f", and none of its {st.f_files} inodes (it can hold no more files)"
        except OSError:
            what += f" on the filesystem of {path}"
        what += "; free space there"
    elif exc.errno in (errno.EMFILE, errno.ENFILE):
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        what += f": the process may hold {soft} open files (RLIMIT_NOFILE); raise ulimit -n or close connections"
    elif exc.errno == errno.EFBIG:
        soft, _hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        what += f": files of this process may not grow past {soft} bytes (RLIMIT_FSIZE); raise ulimit -f"
    return what


def append_result(path: str | os.PathLike[str], row: dict[str, Any]) -> None:
    """Append one rollout result row as a JSON line and fsync it (rollouts are few; safety wins).

    A write that fails part-way (a full disk) is cut off again, so the file never holds a torn line that a
    later row would be glued to; the error says why (:func:`write_failure`). A torn line that a killed writer
    left is ended first: it lands as one reject, and this row after it.
    """
    line = (json.dumps(row, separators=(",", ":"), default=str) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            # a writer killed inside its write; ending its line costs at most an empty line (skipped by
            # readers) where another writer was still appending
            line = b"\n" + line
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise CaptureError(f"could not append a rollout result to {path}: {write_failure(exc, path)}") from exc
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
