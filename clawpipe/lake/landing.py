"""Landing: capture segments and rollout result files -> ``model_calls``, ``rollouts`` and ``rejects``.

``land(captures_dir, lake_root)`` (captures: a folder, or a capture prefix on object storage, mirrored
into a local cache first) reads every sealed segment and the complete frames of open ones from
where the manifest says the last landing stopped, parses each record (:mod:`clawpipe.lake.parse`) into
one row per call and choice, and writes hive-partitioned Parquet parts (``.inprogress`` name, then
rename). Rollout result lines are merged into their partition (latest attempt wins). Work is committed
in batches (:mod:`clawpipe.lake.manifest`); call ids already in a partition are skipped, so re-landing
adds nothing and a landing killed anywhere and rerun ends with every call exactly once.

Memory stays flat: frames stream one at a time and rows are flushed as Parquet row groups every
``row_group_bytes`` of input.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from clawpipe import capture, objstore, schemas, tables
from clawpipe.lake import id_index, manifest, rows, sources
from clawpipe.lake.parse import parse_response
from clawpipe.tables import TMP_SUFFIX, LakeFS

log = logging.getLogger(__name__)

_SAFE_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]*$")
_RECORD_PREVIEW = 2000
_RESPONSE = schemas.MODEL_CALLS.get_field_index("response")
_SEGMENT = schemas.MODEL_CALLS.get_field_index("segment")
_OFFSET = schemas.MODEL_CALLS.get_field_index("offset")
# Fault injection for the kill tests: SIGKILL this process right after publishing the parts of the
# N-th batch (1-based), before its commit: the worst moment to die.
_CRASH_ENV = "CLAWPIPE_LAKE_CRASH_BEFORE_COMMIT"


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
    segments: int = 0  # segments read (new bytes found)
    bytes: int = 0  # capture bytes read
    batches: int = 0
    seconds: float = 0.0
    partitions: set[tuple[str, int]] = field(default_factory=set)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "partitions"}
        d["partitions"] = sorted(f"{r}/{i}" for r, i in self.partitions)
        return d


def _check_part(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"header {what} missing or not a string")
    if what == "run_id" and not _SAFE_PART.match(value):
        raise ValueError(f"run_id {value!r} is not usable as a partition name (letters, digits, ._:@+-)")
    return value


class _Partition:
    def __init__(self, lake: LakeFS, run_id: str, iteration: int) -> None:
        self.run_id, self.iteration = run_id, iteration
        self.rel = tables.partition_rel("model_calls", run_id, iteration)
        # committed parts are checked through their id sidecars, a row group at a time (flush_rows);
        # this run's own calls through a set, as they are met
        self.index = id_index.PartitionIndex(lake, self.rel)
        self.seen: set[str] = set()
        self.rows: list[tuple[Any, ...]] = []
        self.landed = 0  # calls landed into this partition by this run
        self.writer: pq.ParquetWriter | None = None
        self.part: str | None = None
        self.part_hashes: list[np.ndarray] = []  # id hashes of the rows written to ``part``


class _Batch:
    """One unit of commit: parts per partition, rejects, rollout rows and the source ranges they cover."""

    def __init__(
        self,
        lake: LakeFS,
        state: manifest.ManifestState,
        partitions: dict[tuple[str, int], _Partition],
        report: LandingReport,
    ) -> None:
        self.lake, self.state, self.partitions, self.report = lake, state, partitions, report
        self.id = uuid.uuid4().hex
        self.parts: list[str] = []
        self.segments: dict[str, list[Any]] = {}  # key -> [start, end, done]
        self.results: dict[str, list[int]] = {}
        self.rejects: list[dict[str, Any]] = []
        self.rollout_rows: dict[tuple[str, int], list[dict[str, Any]]] = {}
        self.bytes = 0
        self.buffered = 0
        self.empty = True

    # -- sources ------------------------------------------------------------------------------------
    def advance_segment(self, key: str, start: int, end: int, done: bool = False) -> None:
        if end <= start and not done:
            return
        rng = self.segments.get(key)
        if rng is None:
            self.segments[key] = [start, end, done]
        else:
            rng[1] = max(rng[1], end)
            rng[2] = rng[2] or done
        self.empty = False

    def advance_results(self, key: str, start: int, end: int) -> None:
        rng = self.results.setdefault(key, [start, end])
        rng[1] = end
        self.empty = False

    def reject(self, source: str, offset: int, reason: str, record: str | None) -> None:
        self.rejects.append(
            {
                "source": source,
                "offset": offset,
                "reason": reason,
                "record": None if record is None else record[:_RECORD_PREVIEW],
                "landed_at": datetime.now(UTC),
            }
        )

    # -- rows ---------------------------------------------------------------------------------------
    def partition(self, run_id: Any, iteration: int) -> _Partition:
        if run_id.__class__ is not str:
            raise rows.BadValue(f"header run_id is a {type(run_id).__name__}, not a string")
        p = self.partitions.get((run_id, iteration))
        if p is None:
            run_id = _check_part(run_id, "run_id")
            p = self.partitions[(run_id, iteration)] = _Partition(self.lake, run_id, iteration)
        return p

    def flush_rows(self) -> None:
        """Write buffered rows as one row group per partition; rows whose lists do not fit become rejects."""
        for p in self.partitions.values():
            if not p.rows:
                continue
            hashes = self._drop_landed(p)
            table = self._calls_table(p) if p.rows else None
            p.rows = []
            if table is None:
                continue
            if p.writer is None:
                p.part = f"{p.rel}/part-{self.id}.parquet"
                self.parts += [p.part, id_index.sidecar(p.part)]  # the sidecar commits (or rolls back) with it
                manifest.write_pending(self.lake, self.id, self.parts)
                p.writer = self.lake.open_parquet_writer(p.part, schemas.MODEL_CALLS)
            p.writer.write_table(table, row_group_size=1 << 20)
            p.part_hashes.append(np.array([hashes[c] for c in pc.unique(table.column(0)).to_pylist()], np.uint64))
        self.buffered = 0

    def _drop_landed(self, p: _Partition) -> dict[str, int]:
        """Drop the buffered calls a committed part already holds (counted as duplicates); returns the
        id hash of every buffered call."""
        call_ids = list(dict.fromkeys([r[0] for r in p.rows]))  # a call's rows are contiguous
        hashes = id_index.hash_ids(call_ids)
        if p.index:
            dup = p.index.landed(call_ids, hashes)
            if dup:
                n_rows = sum(1 for r in p.rows if r[0] in dup)
                p.rows = [r for r in p.rows if r[0] not in dup]
                self.report.calls -= len(dup)
                self.report.rows -= n_rows
                self.report.duplicates += len(dup)
                p.landed -= len(dup)  # they stay in p.seen: landed already, so any further copy is one too
        return dict(zip(call_ids, hashes.tolist(), strict=True))

    def _calls_table(self, p: _Partition) -> pa.Table | None:
        """The partition's buffered rows as Arrow, less the calls with a row that does not fit (rejected)."""
        try:
            return rows.calls_table(p.rows)
        except rows.BadRows as exc:
            bad: dict[str, tuple[tuple[Any, ...], str]] = {}
            for i, reason in sorted(exc.bad.items()):
                bad.setdefault(p.rows[i][0], (p.rows[i], reason))
        for call_id, (row, reason) in bad.items():
            n = sum(1 for r in p.rows if r[0] == call_id)
            response = row[_RESPONSE] or b""
            self.reject(
                row[_SEGMENT],
                row[_OFFSET],
                reason,
                f"{call_id} {response[:_RECORD_PREVIEW].decode('utf-8', 'replace')}",
            )
            self.report.rejects += 1
            self.report.calls -= 1
            self.report.rows -= n
            p.seen.discard(call_id)
            p.landed -= 1
        keep = [r for r in p.rows if r[0] not in bad]
        return rows.calls_table(keep) if keep else None

    def commit(self, report: LandingReport) -> None:
        if self.empty and not self.rejects:
            return
        self.flush_rows()
        if self.rejects:
            part = f"rejects/part-{self.id}.parquet"
            self.parts.append(part)
            manifest.write_pending(self.lake, self.id, self.parts)
            self.lake.write_parquet(part, pa.Table.from_pylist(self.rejects, schema=schemas.REJECTS))
        manifest.check_writer(self.state)  # an object-store lease must still be ours before parts show
        for p in self.partitions.values():
            if p.writer is not None and p.part is not None:
                p.writer.close()
                self.lake.move(p.part + TMP_SUFFIX, p.part)
                self.lake.write_bytes(id_index.sidecar(p.part), id_index.encode(np.concatenate(p.part_hashes)))
                p.writer, p.part, p.part_hashes = None, None, []
        for (run_id, iteration), new_rows in self.rollout_rows.items():
            _merge_rollouts(self.lake, run_id, iteration, new_rows)
        report.batches += 1
        if os.environ.get(_CRASH_ENV) == str(report.batches):
            os.kill(os.getpid(), 9)
        entry = {"segments": self.segments, "results": self.results, "parts": self.parts}
        manifest.commit(self.lake, self.id, entry, self.state)
        self.state.merge(entry)
        self.state.n_entries += 1
        if self.state.n_entries >= manifest.CHECKPOINT_EVERY:
            manifest.checkpoint(self.lake, self.state)


def _add_call(batch: _Batch, header: capture.CaptureHeader, request: bytes, response: bytes, seg: str, off: int) -> int:
    """Parse one record into rows of its partition; returns rows added (0 for a duplicate call).

    Every value is checked against its column here (the header's by its struct; lists: their element types
    here, their ranges per row group); a value that does not fit raises :class:`rows.BadValue` and the record
    is a reject.
    """
    call_id, run_id, rollout_id, iteration = header.call_id, header.run_id, header.rollout_id, header.iteration
    part = batch.partition(run_id, iteration)
    if call_id in part.seen:
        return 0
    api = header.api or ""
    stream = header.stream
    http_status = header.http_status
    status: str | None = header.status
    parsed = parse_response(api, stream, response, http_status=http_status)
    token_source: str | None = header.token_source
    prompt_ids = parsed.prompt_token_ids
    choice_ids: list[Any] = [c.token_ids for c in parsed.choices]
    choice_lps: list[Any] = [c.logprobs for c in parsed.choices]
    typed = parsed.typed
    if token_source == "retokenized":
        retok = header.retokenized
        prompt_ids = retok.prompt_token_ids if retok is not None else None
        rchoices = retok.choices if retok is not None else []
        n = max(len(parsed.choices), len(rchoices))
        choice_ids = [rchoices[i].token_ids if i < len(rchoices) else None for i in range(n)]
        choice_lps = [None] * n
        typed = False
    prompt_arr = rows.id_array(prompt_ids, "prompt_token_ids", typed)
    choice_ids = [rows.id_array(x, "completion_token_ids", typed) for x in choice_ids]
    choice_lps = [rows.logprob_array(x, "completion_logprobs", typed) for x in choice_lps]
    n_rows = max(1, len(choice_ids))
    if token_source is None:
        has_prompt = prompt_arr is not None or any(c.prompt_token_ids is not None for c in parsed.choices)
        token_source = "upstream" if has_prompt or any(x is not None for x in choice_ids) else "none"
    t_start, t_end = header.t_start, header.t_end
    latency = (t_end - t_start) * 1000.0 if t_start is not None and t_end is not None else None
    stamp = header.policy_version
    engine_version = rows.int_value(parsed.policy_version, "response policy_version", 0, rows.INT64_MAX)
    # the engine knows which weights sampled the call; the proxy's stamp can lag a publish it was not told of
    policy_version = stamp if engine_version is None else engine_version
    if stamp is not None and engine_version is not None and stamp != engine_version:
        batch.report.policy_version_mismatches += 1
    if status == "ok" and (parsed.stream_error or parsed.error is not None):
        # a 200 answer that is an error: mostly a stream whose last event is one (the engine stopped part-way)
        status = "upstream_error"
        batch.report.stream_errors += 1
    prompt_tokens = rows.int_value(parsed.prompt_tokens, "usage prompt_tokens")
    if prompt_tokens is None and prompt_arr is not None:
        prompt_tokens = len(prompt_arr)
    usage_completion = rows.int_value(parsed.completion_tokens, "usage completion_tokens")
    spliced = rows.int_value(parsed.spliced_tokens, "response spliced_tokens")
    changes_json = bytes(header.request_changes)
    changes = None if changes_json == b"null" else changes_json.decode()
    error = header.error or rows.text(parsed.error)
    model = header.model or rows.text(parsed.model)
    t0 = None if t_start is None else int(t_start * 1_000_000)
    t1 = None if t_end is None else int(t_end * 1_000_000)
    upstream_ms, seq, path = header.upstream_ms, header.seq, header.path
    out = part.rows
    for i in range(n_rows):
        choice = parsed.choices[i] if i < len(parsed.choices) else None
        row_prompt = prompt_arr
        if choice is not None and choice.prompt_token_ids is not None and token_source != "retokenized":
            row_prompt = rows.id_array(choice.prompt_token_ids, "prompt_token_ids", typed)
        ids = choice_ids[i] if i < len(choice_ids) else None
        lps = choice_lps[i] if i < len(choice_lps) else None
        completion_tokens = len(ids) if ids is not None else usage_completion if n_rows == 1 else None
        tools = choice.tool_calls if choice is not None else None
        index = rows.int_value(choice.index, "choice index") if choice is not None else None
        out.append(
            (
                call_id,
                i if index is None else index,
                run_id,
                iteration,
                rollout_id,
                seq,
                api,
                path,
                stream,
                request,
                changes,
                parsed.response,
                status,
                http_status,
                error,
                model,
                policy_version,
                stamp,
                row_prompt,
                ids,
                lps,
                rows.text(choice.finish_reason) if choice is not None else None,
                token_source,
                prompt_tokens if prompt_tokens is not None or row_prompt is None else len(row_prompt),
                completion_tokens,
                spliced,
                None if not tools else orjson.dumps(tools).decode(),
                t0,
                t1,
                latency,
                upstream_ms,
                seg,
                off,
            )
        )
    part.seen.add(call_id)
    part.landed += 1
    return n_rows


# -- rollouts --------------------------------------------------------------------------------------


def _coerce_rollout(row: dict[str, Any]) -> dict[str, Any]:
    out = rows.rollout_row(row)
    _check_part(out["rollout_id"], "rollout_id")
    _check_part(out["run_id"], "run_id")
    return out


def _merge_rollouts(lake: LakeFS, run_id: str, iteration: int, rows: list[dict[str, Any]]) -> None:
    """Rewrite a rollouts partition with its rows plus ``rows``; per rollout_id the latest attempt wins
    (highest ``attempt``, then the later landed)."""
    rel = tables.partition_rel("rollouts", run_id, iteration)
    existing: list[dict[str, Any]] = []
    for part in lake.list_files(rel, suffix=".parquet"):
        existing.extend(lake.read_parquet(part).to_pylist())
    best: dict[str, tuple[tuple[int, int], dict[str, Any]]] = {}
    for order, row in enumerate(existing + rows):
        key = (row.get("attempt") or 0, order)
        cur = best.get(row["rollout_id"])
        if cur is None or key >= cur[0]:
            best[row["rollout_id"]] = (key, row)
    merged = [r for _, r in sorted(best.values(), key=lambda kv: kv[0][1])]
    tables.replace_partition(lake, "rollouts", run_id, iteration, pa.Table.from_pylist(merged, schema=schemas.ROLLOUTS))


# -- the landing loop --------------------------------------------------------------------------------


def _damage_reason(d: sources.Damage) -> str:
    return (
        f"damaged capture region: {d.end - d.offset} bytes at offset {d.offset} ({d.reason}); "
        f"landing resumed at the next intact frame (offset {d.end})"
    )


def _damage_preview(f: Any, d: sources.Damage) -> str:
    """The first bytes of a damaged region as text, for a person deciding what was lost."""
    data = os.pread(f.fileno(), min(d.end - d.offset, _RECORD_PREVIEW), d.offset)  # leaves the reader's position
    return data.decode("utf-8", "replace")


def _preview(header: capture.CaptureHeader | None, payload: bytes) -> str:
    head = msgspec.json.encode(header).decode() if header is not None else ""
    return f"{head} {payload[:_RECORD_PREVIEW].decode('utf-8', 'replace')}"


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
        self.partitions: dict[tuple[str, int], _Partition] = {}
        self.report = LandingReport()
        self.batch = _Batch(lake, state, self.partitions, self.report)

    def commit(self) -> None:
        self.batch.commit(self.report)
        if self.progress is not None:
            self.progress(self.report)
        self.batch = _Batch(self.lake, self.state, self.partitions, self.report)

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
                if batch.bytes >= self.batch_bytes:
                    batch.advance_segment(seg.key, start, pos)
                    self.commit()
                    batch, start = self.batch, pos
            batch.advance_segment(seg.key, start, pos, done=sealed)
        report.bytes += pos - landed
        report.segments += pos > landed

    def land_results(self, key: str, path: Path) -> None:
        start = self.state.results.get(key, 0)
        try:
            if path.stat().st_size <= start:
                return
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
                out = _coerce_rollout(row)
            except (ValueError, TypeError, KeyError, OverflowError, pa.ArrowException) as exc:
                batch.reject(key, offset, f"bad rollout row: {exc}", orjson.dumps(row).decode())
                report.rejects += 1
                continue
            batch.rollout_rows.setdefault((out["run_id"], out["iteration"]), []).append(out)
            report.rollouts += 1
        batch.advance_results(key, start, end)


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
        for seg in sources.list_segments(captures):
            lander.land_segment(seg)
        for key, path in sources.list_results(captures):
            lander.land_results(key, path)
        lander.commit()
    report = lander.report
    report.partitions = {k for k, p in lander.partitions.items() if p.landed}
    report.seconds = time.perf_counter() - t0
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
