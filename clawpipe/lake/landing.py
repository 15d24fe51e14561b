"""Landing: capture segments and rollout result files -> ``model_calls``, ``rollouts`` and ``rejects``.

``land(captures_dir, lake_root)`` (captures: a folder, or a capture prefix on object storage, mirrored
into a local cache first) reads every sealed segment and the complete frames of open ones from
where the manifest says the last landing stopped, turns each record into the values of its rows by
column name (:mod:`clawpipe.lake.records`), buffers them per partition column by column
(:mod:`clawpipe.lake.columns`) and writes hive-partitioned Parquet parts committed in batches
(:mod:`clawpipe.lake.batch`). Rollout result lines are merged into their partition (latest attempt wins,
:mod:`clawpipe.lake.rollouts`). Call ids already in a partition are skipped, so re-landing adds nothing
and a landing killed anywhere and rerun ends with every call exactly once.

Memory stays flat: frames stream one at a time and rows are flushed as Parquet row groups every
``row_group_bytes`` of input.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import orjson
import pyarrow as pa

from clawpipe import capture, objstore
from clawpipe.errors import LakeError
from clawpipe.lake import manifest, records, sources
from clawpipe.lake.batch import RECORD_PREVIEW, Batch, Partition
from clawpipe.lake.rollouts import coerce_rollout
from clawpipe.tables import LakeFS, mark_format

log = logging.getLogger(__name__)

# Partitions one batch writes at most: each holds an open part file until the batch commits, so a landing of
# thousands of iterations or runs commits every OPEN_PARTS partitions instead of holding a descriptor per one.
OPEN_PARTS = 32


@dataclass
class LandingReport:
    """What one landing did."""

    calls: int = 0  # new calls landed
    rows: int = 0  # new model_calls rows (call x choice)
    duplicates: int = 0  # calls skipped because their call_id was already landed
    rollouts: int = 0  # result lines landed into rollouts
    rejects: int = 0
    damaged_bytes: int = 0  # capture bytes in damaged regions (each region is one reject)
    policy_version_mismatches: int = 0  # calls whose engine-reported policy_version is not the proxy's stamp
    stream_errors: int = 0  # 200 answers that are errors (streams ending in an error event): upstream_error
    held_back: list[str] = field(default_factory=list)  # segments in a later clawpipe's framing, left unlanded
    segments: int = 0  # segments read (new bytes found)
    bytes: int = 0  # capture bytes read
    batches: int = 0
    seconds: float = 0.0
    partitions: set[tuple[str, int]] = field(default_factory=set)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "partitions"}
        d["partitions"] = sorted(f"{r}/{i}" for r, i in self.partitions)
        return d


# -- the landing loop --------------------------------------------------------------------------------


def _add_call(
    batch: Batch, header: capture.CaptureHeader, request: memoryview, response: memoryview, seg: str, off: int
) -> int:
    """One record onto its partition's columns; returns the rows added (0 for a call this run met already)."""
    part = batch.partition(header.run_id, header.iteration)
    call_id = header.call_id
    if call_id in part.seen:
        return 0
    batch.touched.add(part)
    values = records.call_values(header, request, response, seg, off)
    part.columns.add(call_id, values.call, values.choices)
    report = batch.report
    report.policy_version_mismatches += values.policy_version_mismatch
    report.stream_errors += values.stream_error
    part.seen.add(call_id)
    part.landed += 1
    return len(values.choices)


def _damage_reason(d: sources.Damage) -> str:
    return (
        f"damaged capture region: {d.end - d.offset} bytes at offset {d.offset} ({d.reason}); "
        f"landing resumed at the next intact frame (offset {d.end})"
    )


def _damage_preview(f: Any, d: sources.Damage) -> str:
    """The first bytes of a damaged region as text, for a person deciding what was lost."""
    data = os.pread(f.fileno(), min(d.end - d.offset, RECORD_PREVIEW), d.offset)  # leaves the reader's position
    return data.decode("utf-8", "replace")


def _preview(header: capture.CaptureHeader | None, payload: bytes) -> str:
    head = msgspec.json.encode(header).decode() if header is not None else ""
    return f"{head} {payload[:RECORD_PREVIEW].decode('utf-8', 'replace')}"


def land(
    captures_dir: str | os.PathLike[str],
    lake_root: str | os.PathLike[str],
    *,
    batch_bytes: int = 256 << 20,
    row_group_bytes: int = 32 << 20,
    progress: Callable[[LandingReport], None] | None = None,
) -> LandingReport:
    """Land everything new under ``captures_dir`` into the lake at ``lake_root`` (path or URL).

    Idempotent: what the manifest records as landed is not read again, and call ids already in a
    partition are skipped. ``batch_bytes`` of input make one commit; ``row_group_bytes`` one row group.
    """
    gc_was_enabled = gc.isenabled()
    gc.disable()  # millions of short-lived acyclic objects: the cyclic collector only costs time here
    try:
        return _land(
            captures_dir, lake_root, batch_bytes=batch_bytes, row_group_bytes=row_group_bytes, progress=progress
        )
    finally:
        if gc_was_enabled:
            gc.enable()


class _Lander:
    """One landing run: walks the sources and cuts the work into committed batches."""

    def __init__(
        self,
        lake: LakeFS,
        state: manifest.ManifestState,
        *,
        batch_bytes: int,
        row_group_bytes: int,
        progress: Callable[[LandingReport], None] | None,
    ) -> None:
        self.lake, self.state = lake, state
        self.batch_bytes, self.row_group_bytes, self.progress = batch_bytes, row_group_bytes, progress
        self.partitions: dict[tuple[str, int], Partition] = {}
        self.report = LandingReport()
        self.batch = Batch(lake, state, self.partitions, self.report)

    def commit(self) -> None:
        self.batch.commit(self.report)
        if self.progress is not None:
            self.progress(self.report)
        self.batch = Batch(self.lake, self.state, self.partitions, self.report)

    def land_segment(self, seg: sources.Segment) -> None:
        st = self.state.segments.get(seg.key)
        if st is not None and st.done:
            return
        landed = st.end if st is not None else 0
        try:
            f, sealed = sources.open_segment(seg)
        except FileNotFoundError:
            return
        report = self.report
        with f:
            size = os.fstat(f.fileno()).st_size
            if landed >= size and not sealed:
                return
            framing = capture.later_framing(os.pread(f.fileno(), 8, 0))
            if framing is not None:  # a later clawpipe's framing: not damage, and not ours to consume
                report.held_back.append(f"segment {seg.key} (framing {framing}) from offset {landed}")
                return
            start = pos = landed
            batch = self.batch
            for item in sources.read_frames(f, landed, sealed=sealed):
                if isinstance(item, sources.Damage):
                    batch.reject(seg.key, item.offset, _damage_reason(item), _damage_preview(f, item))
                    report.rejects += 1
                    report.damaged_bytes += item.end - item.offset
                    n = item.end - pos
                    pos = item.end
                    batch.bytes += n
                    continue
                header = None
                try:
                    where = f"segment {seg.key}, record at offset {item.offset}"
                    header, request, response = sources.decode_payload(item.payload, where)
                    rows = _add_call(batch, header, request, response, seg.key, item.offset)
                    if rows:
                        report.calls += 1
                        report.rows += rows
                    else:
                        report.duplicates += 1
                except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError) as exc:
                    # ParseError and rows.BadValue are ValueErrors; the others are shapes no parser
                    # anticipated: a reject too
                    reason = str(exc) if isinstance(exc, ValueError) else f"unexpected record: {exc!r}"
                    batch.reject(seg.key, item.offset, reason, _preview(header, item.payload))
                    report.rejects += 1
                n = item.end - pos
                pos = item.end
                batch.bytes += n
                batch.buffered += n
                if batch.buffered >= self.row_group_bytes:
                    batch.flush_rows()
                if batch.bytes >= self.batch_bytes or len(batch.touched) >= OPEN_PARTS:
                    batch.advance_segment(seg.key, start, pos)
                    self.commit()
                    batch, start = self.batch, pos
            batch.advance_segment(seg.key, start, pos, done=sealed)
        report.bytes += pos - landed
        report.segments += pos > landed

    def land_results(self, key: str, path: Path, size: int) -> None:
        """Land the rows of results file ``path`` past what the manifest says is landed (``size``: its bytes
        when listed; a file no longer than that is skipped without opening it)."""
        start = self.state.results.get(key, 0)
        if size <= start:
            return
        try:
            lines, end = sources.read_result_lines(path, start)
        except FileNotFoundError:
            return
        batch, report = self.batch, self.report
        for offset, row, reason in lines:
            if row is None:
                batch.reject(key, offset, reason or "bad result line", None)
                report.rejects += 1
                continue
            try:
                out = coerce_rollout(row)
            except (ValueError, TypeError, KeyError, OverflowError, pa.ArrowException) as exc:
                batch.reject(key, offset, f"bad rollout row: {exc}", orjson.dumps(row).decode())
                report.rejects += 1
                continue
            batch.rollout_rows.setdefault((out["run_id"], out["iteration"]), []).append(out)
            report.rollouts += 1
        batch.advance_results(key, start, end)


def _stopped(lake: LakeFS, report: LandingReport, exc: OSError | MemoryError) -> str:
    """Why a landing stopped (a full disk, no descriptor or memory left) and what to do, for a person."""
    if isinstance(exc, OSError):
        where = lake.root if lake.is_local else lake.url
        why = capture.write_failure(exc, where) if lake.is_local else f"{exc}"
        if exc.filename:
            why = f"{exc.filename}: {why}"
    else:
        why = f"out of memory ({str(exc) or 'MemoryError'}); give the landing more memory, or land with a smaller "
        why += "row_group_bytes (rows are buffered that long)"
    return (
        f"landing into {lake.url} stopped: {why}. The batch under way was rolled back (none of it is visible); "
        f"the {report.batches} batches committed before it stay. Run the landing again once that is fixed: "
        "it lands the rest, every call exactly once."
    )


def _land(
    captures_dir: str | os.PathLike[str],
    lake_root: str | os.PathLike[str],
    *,
    batch_bytes: int,
    row_group_bytes: int,
    progress: Callable[[LandingReport], None] | None,
) -> LandingReport:
    t0 = time.perf_counter()
    captures = objstore.local_captures(captures_dir)  # a capture prefix on object storage is mirrored first
    lake = LakeFS(lake_root)
    with manifest.lake_lock(lake) as lease:
        state = manifest.load(lake, lease)
        lander = _Lander(lake, state, batch_bytes=batch_bytes, row_group_bytes=row_group_bytes, progress=progress)
        try:
            mark_format(lake)  # so a later clawpipe that changes the format knows this one's lakes
            for seg in sources.list_segments(captures):
                lander.land_segment(seg)
            for res in sources.list_results(captures):
                lander.land_results(*res)
            lander.commit()
        except (OSError, MemoryError) as exc:
            message = _stopped(lake, lander.report, exc)  # the space as it was when the write failed
            lander.batch.rollback()  # nothing of the batch under way stays visible or takes space
            raise LakeError(message) from exc
    report = lander.report
    report.partitions = {k for k, p in lander.partitions.items() if p.landed}
    report.seconds = time.perf_counter() - t0
    if report.held_back:
        # all else is committed; these wait, unlanded, for a clawpipe that reads their format
        raise LakeError(
            f"landed {report.calls} calls into {lake.url}, but held back {len(report.held_back)} captures written "
            f"by a later clawpipe (left unlanded; upgrade clawpipe and land again): {'; '.join(report.held_back[:5])}"
        )
    if report.policy_version_mismatches:
        log.warning(
            "%d calls: the engine reported a policy_version other than the proxy's stamp; the lake keeps the "
            "engine's (proxy_policy_version holds the stamp; `clawpipe lake check` lists them)",
            report.policy_version_mismatches,
        )
    log.info(
        "landed calls=%d rows=%d duplicates=%d rollouts=%d rejects=%d batches=%d in %.2fs",
        report.calls,
        report.rows,
        report.duplicates,
        report.rollouts,
        report.rejects,
        report.batches,
        report.seconds,
    )
    return report
