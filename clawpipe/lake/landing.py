"""Landing: capture segments and rollout result files -> ``model_calls``, ``rollouts`` and ``rejects``.

``land(captures_dir, lake_root)`` reads every sealed segment and the complete frames of open ones from
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
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from clawpipe import schemas, tables
from clawpipe.lake import manifest, sources
from clawpipe.lake.parse import ParseError, parse_response
from clawpipe.tables import TMP_SUFFIX, LakeFS

log = logging.getLogger(__name__)

_SAFE_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]*$")
_RECORD_PREVIEW = 2000
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


def _num(v: Any, kind: type, what: str) -> Any:
    """``v`` as int/float (None stays None); a value of another type is a reject, not a crash at flush."""
    if v is None or (type(v) is kind):
        return v
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise ValueError(f"header {what} is a {type(v).__name__}, not a number")
    try:
        return kind(v)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"header {what}={v!r} is not a number") from exc


def _text(v: Any) -> str | None:
    """``v`` for a string column: text as is, JSON for structures, str() for the rest (never a crash at flush)."""
    if v is None or v.__class__ is str:
        return v
    if isinstance(v, dict | list):
        return orjson.dumps(v).decode()
    return str(v)


def _us(t: Any) -> int | None:
    return None if t is None else int(float(t) * 1_000_000)


def _json_or_none(v: Any) -> str | None:
    return None if v is None else orjson.dumps(v).decode()


_LIST_DTYPES = {schemas.IDS: np.int32, schemas.LOGPROBS: np.float32}
_BYTES_COLUMNS = frozenset({"request", "response"})  # kept as the captured bytes until the Arrow cast


def _np_or_none(values: Any, dtype: Any) -> np.ndarray | None:
    if values is None or isinstance(values, np.ndarray):
        return values
    return np.fromiter(values, dtype=dtype, count=len(values))


def _list_array(items: tuple[Any, ...], dtype: Any, value_type: pa.DataType) -> pa.Array:
    """A list<value_type> Arrow array from per-row lists or NumPy arrays (None = null).

    Runs of Python lists are flattened in one C loop (``np.fromiter`` over a chain): cheaper than a
    NumPy conversion per row.
    """
    n = len(items)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum([0 if x is None else len(x) for x in items], out=offsets[1:])
    pieces: list[np.ndarray] = []
    run: list[Any] = []
    for x in items:
        if x is None or not len(x):
            continue
        if isinstance(x, np.ndarray):
            if run:
                pieces.append(np.fromiter(chain.from_iterable(run), dtype=dtype, count=sum(map(len, run))))
                run = []
            pieces.append(x.astype(dtype, copy=False))
        else:
            run.append(x)
    if run:
        pieces.append(np.fromiter(chain.from_iterable(run), dtype=dtype, count=sum(map(len, run))))
    values = np.concatenate(pieces) if pieces else np.empty(0, dtype=dtype)
    nulls = [x is None for x in items]
    mask = pa.array(nulls, type=pa.bool_()) if any(nulls) else None
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type), mask=mask)


def _calls_table(rows: list[tuple[Any, ...]]) -> pa.Table:
    """Arrow table of model_calls rows (tuples in schema order), column by column."""
    cols = list(zip(*rows, strict=True))
    arrays = []
    for f, col in zip(schemas.MODEL_CALLS, cols, strict=True):
        if f.type in _LIST_DTYPES:
            arrays.append(_list_array(col, _LIST_DTYPES[f.type], f.type.value_type))
        elif f.name in _BYTES_COLUMNS:
            try:
                arrays.append(pa.array(col, type=pa.binary()).cast(pa.string()))
            except pa.ArrowInvalid:  # not UTF-8: keep what can be read
                arrays.append(pa.array([None if v is None else v.decode("utf-8", "replace") for v in col], pa.string()))
        elif pa.types.is_timestamp(f.type):
            arrays.append(pa.array(col, type=pa.int64()).view(f.type))
        else:
            arrays.append(pa.array(col, type=f.type))
    return pa.Table.from_arrays(arrays, schema=schemas.MODEL_CALLS)


class _Partition:
    def __init__(self, lake: LakeFS, run_id: str, iteration: int) -> None:
        self.run_id, self.iteration = run_id, iteration
        self.rel = tables.partition_rel("model_calls", run_id, iteration)
        self.seen: set[str] = _landed_call_ids(lake, self.rel)
        self.rows: list[tuple[Any, ...]] = []
        self.landed = 0  # calls landed into this partition by this run
        self.writer: pq.ParquetWriter | None = None
        self.part: str | None = None


def _landed_call_ids(lake: LakeFS, rel: str) -> set[str]:
    seen: set[str] = set()
    for part in lake.list_files(rel, suffix=".parquet"):
        col = lake.read_parquet(part, columns=["call_id"]).column("call_id")
        seen.update(col.to_pylist())
    return seen


class _Batch:
    """One unit of commit: parts per partition, rejects, rollout rows and the source ranges they cover."""

    def __init__(self, lake: LakeFS, state: manifest.ManifestState, partitions: dict[tuple[str, int], _Partition]):
        self.lake, self.state, self.partitions = lake, state, partitions
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
        p = self.partitions.get((run_id, iteration))
        if p is None:
            run_id = _check_part(run_id, "run_id")
            p = self.partitions[(run_id, iteration)] = _Partition(self.lake, run_id, iteration)
        return p

    def flush_rows(self) -> None:
        """Write buffered rows as one row group per partition."""
        for p in self.partitions.values():
            if not p.rows:
                continue
            if p.writer is None:
                p.part = f"{p.rel}/part-{self.id}.parquet"
                self.parts.append(p.part)
                manifest.write_pending(self.lake, self.id, self.parts)
                p.writer = self.lake.open_parquet_writer(p.part, schemas.MODEL_CALLS)
            p.writer.write_table(_calls_table(p.rows), row_group_size=1 << 20)
            p.rows = []
        self.buffered = 0

    def commit(self, report: LandingReport) -> None:
        if self.empty and not self.rejects:
            return
        self.flush_rows()
        if self.rejects:
            part = f"rejects/part-{self.id}.parquet"
            self.parts.append(part)
            manifest.write_pending(self.lake, self.id, self.parts)
            self.lake.write_parquet(part, pa.Table.from_pylist(self.rejects, schema=schemas.REJECTS))
        for p in self.partitions.values():
            if p.writer is not None and p.part is not None:
                p.writer.close()
                self.lake.move(p.part + TMP_SUFFIX, p.part)
                p.writer, p.part = None, None
        for (run_id, iteration), rows in self.rollout_rows.items():
            _merge_rollouts(self.lake, run_id, iteration, rows)
        report.batches += 1
        if os.environ.get(_CRASH_ENV) == str(report.batches):
            os.kill(os.getpid(), 9)
        entry = {"segments": self.segments, "results": self.results, "parts": self.parts}
        manifest.commit(self.lake, self.id, entry)
        self.state.merge(entry)
        self.state.n_entries += 1
        if self.state.n_entries >= manifest.CHECKPOINT_EVERY:
            manifest.checkpoint(self.lake, self.state)


def _add_call(batch: _Batch, header: dict[str, Any], request: bytes, response: bytes, seg: str, off: int) -> int:
    """Parse one record into rows of its partition; returns rows added (0 for a duplicate call)."""
    call_id = _check_part(header.get("call_id"), "call_id")
    run_id = header.get("run_id")  # checked when its partition is first met (batch.partition)
    rollout_id = _check_part(header.get("rollout_id"), "rollout_id")
    try:
        iteration = int(header["iteration"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"header iteration missing or not an integer: {exc}") from exc
    part = batch.partition(run_id, iteration)
    if call_id in part.seen:
        return 0
    api = _text(header.get("api")) or ""
    stream = bool(header.get("stream"))
    parsed = parse_response(api, stream, response, http_status=header.get("http_status"))
    token_source = _text(header.get("token_source"))
    prompt_ids = parsed.prompt_token_ids
    choice_ids: list[Any] = [c.token_ids for c in parsed.choices]
    choice_lps: list[Any] = [c.logprobs for c in parsed.choices]
    if token_source == "retokenized":
        retok = header.get("retokenized") or {}
        prompt_ids = retok.get("prompt_token_ids")
        rchoices = retok.get("choices") or []
        n = max(len(parsed.choices), len(rchoices))
        choice_ids = [rchoices[i].get("token_ids") if i < len(rchoices) else None for i in range(n)]
        choice_lps = [None] * n
    n_rows = max(1, len(choice_ids))
    if token_source is None:
        token_source = "upstream" if prompt_ids is not None or any(x is not None for x in choice_ids) else "none"
    t_start, t_end = _num(header.get("t_start"), float, "t_start"), _num(header.get("t_end"), float, "t_end")
    latency = (float(t_end) - float(t_start)) * 1000.0 if t_start is not None and t_end is not None else None
    policy_version = header.get("policy_version")
    if policy_version is None:
        policy_version = parsed.policy_version
    policy_version = _num(policy_version, int, "policy_version")
    prompt_tokens = _num(parsed.prompt_tokens, int, "usage prompt tokens")
    if prompt_tokens is None and prompt_ids is not None:
        prompt_tokens = len(prompt_ids)
    prompt_arr = _np_or_none(prompt_ids, np.int32)
    changes = _json_or_none(header.get("request_changes"))
    status, http_status = _text(header.get("status")), _num(header.get("http_status"), int, "http_status")
    error = _text(header.get("error") or parsed.error)
    model = _text(header.get("model") or parsed.model)
    t0, t1 = _us(t_start), _us(t_end)
    upstream_ms = _num(header.get("upstream_ms"), float, "upstream_ms")
    seq = _num(header.get("seq"), int, "seq")
    path = _text(header.get("path"))
    rows = part.rows
    for i in range(n_rows):
        choice = parsed.choices[i] if i < len(parsed.choices) else None
        ids = _np_or_none(choice_ids[i] if i < len(choice_ids) else None, np.int32)
        lps = _np_or_none(choice_lps[i] if i < len(choice_lps) else None, np.float32)
        completion_tokens = len(ids) if ids is not None else parsed.completion_tokens if n_rows == 1 else None
        completion_tokens = _num(completion_tokens, int, "usage completion tokens")
        tools = choice.tool_calls if choice is not None else None
        rows.append(
            (
                call_id,
                _num(choice.index, int, "choice index") if choice is not None else i,
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
                prompt_arr,
                ids,
                lps,
                _text(choice.finish_reason) if choice is not None else None,
                token_source,
                prompt_tokens,
                completion_tokens,
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

_TS_FIELDS = {f.name for f in schemas.ROLLOUTS if pa.types.is_timestamp(f.type)}
_JSON_FIELDS = {"reward_info"}


def _coerce_rollout(row: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in schemas.ROLLOUTS:
        v = row.get(f.name)
        if v is not None and f.name in _TS_FIELDS:
            if isinstance(v, str):
                v = datetime.fromisoformat(v)
                if v.tzinfo is None:
                    v = v.replace(tzinfo=UTC)
            elif isinstance(v, int | float):
                v = datetime.fromtimestamp(float(v), UTC)
        elif v is not None and f.name in _JSON_FIELDS and not isinstance(v, str):
            v = orjson.dumps(v).decode()
        out[f.name] = v
    _check_part(out["rollout_id"], "rollout_id")
    _check_part(out["run_id"], "run_id")
    out["iteration"] = int(out["iteration"])
    pa.Table.from_pylist([out], schema=schemas.ROLLOUTS)  # raises on a value of the wrong type
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


def _preview(header: dict[str, Any] | None, payload: bytes) -> str:
    head = orjson.dumps(header).decode() if header is not None else ""
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
        self.batch = _Batch(lake, state, self.partitions)

    def commit(self) -> None:
        self.batch.commit(self.report)
        if self.progress is not None:
            self.progress(self.report)
        self.batch = _Batch(self.lake, self.state, self.partitions)

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
                    header, request, response = sources.decode_payload(item.payload)
                    rows = _add_call(batch, header, request, response, seg.key, item.offset)
                    if rows:
                        report.calls += 1
                        report.rows += rows
                    else:
                        report.duplicates += 1
                except (ValueError, TypeError, KeyError, AttributeError, ParseError) as exc:
                    # ParseError is a ValueError; the others are shapes no parser anticipated: a reject too
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
            except (ValueError, TypeError, KeyError, pa.ArrowException) as exc:
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
    captures = Path(captures_dir)
    lake = LakeFS(lake_root)
    with manifest.lake_lock(lake):
        lander = _Lander(
            lake, manifest.load(lake), batch_bytes=batch_bytes, row_group_bytes=row_group_bytes, progress=progress
        )
        for seg in sources.list_segments(captures):
            lander.land_segment(seg)
        for key, path in sources.list_results(captures):
            lander.land_results(key, path)
        lander.commit()
    report = lander.report
    report.partitions = {k for k, p in lander.partitions.items() if p.landed}
    report.seconds = time.perf_counter() - t0
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
