"""Values for the lake's columns, checked: every value of a record fits its column's type and range, or the
record is a reject with a reason naming the column (one bad value never stops a landing).

Scalars are checked per record as they are read (:func:`int_value`, :func:`float_value`, ...). Token-id
and logprob lists become NumPy arrays per record, their element types checked where no typed decoder
has done it already and ids checked to fit int32 (:func:`id_array`); ids below 0 and logprobs that are
not finite are looked for once per row group over the whole column (:func:`calls_table`): a row group
with a bad list falls back to finding its rows, which become rejects, and the rest is written.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import msgspec
import numpy as np
import orjson
import pyarrow as pa

from clawpipe import schemas

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
EPOCH_MAX_S = 253_402_300_800.0  # 10000-01-01: the last second a timestamp column holds
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class BadValue(ValueError):
    """A value that does not fit its column: the record becomes a reject with this message."""


def int_value(v: Any, what: str, lo: int = 0, hi: int = INT32_MAX) -> int | None:
    """``v`` as an int in ``[lo, hi]`` (None stays None). Integral floats and decimal strings are accepted;
    bools, fractions and anything else are not."""
    if v.__class__ is int and lo <= v <= hi:  # the common case first: this runs several times per record
        return v
    if v is None:
        return None
    if v.__class__ is not int:
        if isinstance(v, bool) or not isinstance(v, int | float | str):
            raise BadValue(f"{what} is a {type(v).__name__}, not an integer")
        try:
            if isinstance(v, float):
                if not v.is_integer():
                    raise ValueError
                v = int(v)
            else:
                v = int(v)
        except (ValueError, OverflowError) as exc:
            raise BadValue(f"{what}={v!r} is not an integer") from exc
    if not lo <= v <= hi:
        raise BadValue(f"{what}={v} is outside [{lo}, {hi}]")
    return v


def float_value(v: Any, what: str) -> float | None:
    """``v`` as a finite float (None stays None)."""
    if v.__class__ is float and -math.inf < v < math.inf:
        return v
    if v is None:
        return None
    if v.__class__ is not float:
        if isinstance(v, bool) or not isinstance(v, int | float | str):
            raise BadValue(f"{what} is a {type(v).__name__}, not a number")
        try:
            v = float(v)
        except (ValueError, OverflowError) as exc:
            raise BadValue(f"{what}={v!r} is not a number") from exc
    if not math.isfinite(v):
        raise BadValue(f"{what}={v} is not finite")
    return v


def epoch_s(v: Any, what: str) -> float | None:
    """Epoch seconds for a timestamp column: finite, in [0, year 10000)."""
    t = float_value(v, what)
    if t is not None and not 0.0 <= t < EPOCH_MAX_S:
        raise BadValue(f"{what}={t} is not an epoch time in seconds (0 to {EPOCH_MAX_S:.0f})")
    return t


def bool_value(v: Any, what: str) -> bool | None:
    if v is None or v.__class__ is bool:
        return v
    raise BadValue(f"{what} is a {type(v).__name__}, not a boolean")


def text(v: Any) -> str | None:
    """``v`` for a free-text column: text as is, JSON for structures, str() for the rest."""
    if v is None or v.__class__ is str:
        return v
    if isinstance(v, dict | list):
        return orjson.dumps(v).decode()
    return str(v)


def one_of(v: Any, what: str, allowed: frozenset[str]) -> str | None:
    """A value of a closed vocabulary (status, token_source)."""
    if v is None or (v.__class__ is str and v in allowed):
        return v
    raise BadValue(f"{what}={v!r} is not one of {', '.join(sorted(allowed))}")


def id_array(v: Any, what: str, typed: bool) -> np.ndarray | None:
    """A token-id list as int32, its elements checked to be ints (not bools, floats or text) unless a typed
    decoder did that, and to fit int32; ids below 0 are found per row group (one pass for all rows)."""
    if v is None:
        return None
    if isinstance(v, np.ndarray):  # the large-body path parsed these as int64
        if v.dtype != np.int32:
            if len(v) and (v.min() < 0 or v.max() > INT32_MAX):
                raise BadValue(f"{what}: {_id_problem(v)}")
            v = v.astype(np.int32)
        return v
    if not typed:
        try:
            v = msgspec.convert(v, list[int])
        except msgspec.ValidationError as exc:
            raise BadValue(f"{what}: {exc}") from exc
    try:
        return np.fromiter(v, dtype=np.int32, count=len(v))
    except OverflowError as exc:
        raise BadValue(f"{what}: {exc} (ids are in [0, {INT32_MAX}])") from exc


def logprob_array(v: Any, what: str, typed: bool) -> np.ndarray | None:
    """A logprob list as float64, its elements checked to be numbers unless a typed decoder did that;
    whether they fit float32 (finite) is checked per row group."""
    if v is None or isinstance(v, np.ndarray):
        return v
    if not typed:
        try:
            v = msgspec.convert(v, list[float])
        except msgspec.ValidationError as exc:
            raise BadValue(f"{what}: {exc}") from exc
    return np.fromiter(v, dtype=np.float64, count=len(v))  # float32 once checked, per row group


# -- columns of many rows ------------------------------------------------------------------------------------


class BadRows(Exception):
    """Rows of a batch whose values do not fit: {row index: reason}."""

    def __init__(self, bad: dict[int, str]) -> None:
        super().__init__(f"{len(bad)} bad rows")
        self.bad = bad


def _bad_list_rows(items: tuple[Any, ...], name: str, check: Any) -> dict[int, str]:
    """Row by row: the rows whose list fails ``check`` (the slow path, taken only when a column failed)."""
    bad: dict[int, str] = {}
    for i, x in enumerate(items):
        problem = None if x is None else check(x)
        if problem:
            bad[i] = f"{name}: {problem}"
    return bad


def _id_problem(arr: np.ndarray) -> str | None:
    if len(arr) and (arr.min() < 0 or (arr.dtype != np.int32 and arr.max() > INT32_MAX)):
        k = int(np.flatnonzero((arr < 0) | (arr > INT32_MAX))[0])
        return f"id {int(arr[k])} at position {k} is outside [0, {INT32_MAX}]"
    return None


def _logprob_problem(arr: np.ndarray) -> str | None:
    fits = np.abs(arr) <= _FLOAT32_MAX  # False for NaN and inf too
    if not fits.all():
        k = int(np.flatnonzero(~fits)[0])
        return f"logprob {float(arr[k])} at position {k} is not a finite float32"
    return None


def _offsets(items: tuple[Any, ...]) -> np.ndarray:
    offsets = np.zeros(len(items) + 1, dtype=np.int32)
    np.cumsum([0 if x is None else len(x) for x in items], out=offsets[1:])
    return offsets


def _list_array(items: tuple[Any, ...], name: str, value_type: pa.DataType) -> pa.Array:
    """A checked list<value_type> Arrow array from per-row NumPy arrays (None = null).

    Ids are checked to be >= 0 and logprobs finite, once over the whole column; raises :class:`BadRows`
    naming the rows that fail.
    """
    is_ids = value_type == pa.int32()
    dtype, check = (np.int32, _id_problem) if is_ids else (np.float64, _logprob_problem)
    pieces = [x for x in items if x is not None and len(x)]
    values = np.concatenate(pieces) if pieces else np.empty(0, dtype=dtype)
    if check(values):
        raise BadRows(_bad_list_rows(items, name, check))
    if not is_ids:
        values = values.astype(np.float32)
    nulls = [x is None for x in items]
    mask = pa.array(nulls, type=pa.bool_()) if any(nulls) else None
    return pa.ListArray.from_arrays(pa.array(_offsets(items)), pa.array(values, type=value_type), mask=mask)


_BYTES_COLUMNS = frozenset({"request", "response"})  # kept as the captured bytes until the Arrow cast


def calls_table(rows: list[tuple[Any, ...]]) -> pa.Table:
    """Arrow table of model_calls rows (tuples in schema order), column by column.

    Raises :class:`BadRows` for rows whose lists do not fit (scalars were checked per record).
    """
    cols = list(zip(*rows, strict=True))
    arrays = []
    bad: dict[int, str] = {}
    for f, col in zip(schemas.MODEL_CALLS, cols, strict=True):
        if pa.types.is_list(f.type):
            try:
                arrays.append(_list_array(col, f.name, f.type.value_type))
            except BadRows as exc:
                for i, reason in exc.bad.items():
                    bad.setdefault(i, reason)
        elif f.name in _BYTES_COLUMNS:
            try:
                arrays.append(pa.array(col, type=pa.binary()).cast(pa.string()))
            except pa.ArrowInvalid:  # not UTF-8: keep what can be read
                arrays.append(pa.array([None if v is None else v.decode("utf-8", "replace") for v in col], pa.string()))
        elif pa.types.is_timestamp(f.type):
            arrays.append(pa.array(col, type=pa.int64()).view(f.type))
        else:
            arrays.append(pa.array(col, type=f.type))
    if bad:
        raise BadRows(bad)
    return pa.Table.from_arrays(arrays, schema=schemas.MODEL_CALLS)


# -- rollout result rows ---------------------------------------------------------------------------------

_ROLLOUT_INTS = {
    "iteration": (0, INT32_MAX),
    "sample_idx": (0, INT32_MAX),
    "exit_code": (-(2**31), INT32_MAX),
    "n_calls": (0, INT32_MAX),
    "attempt": (0, INT32_MAX),
    "policy_version": (0, INT64_MAX),
}
_ROLLOUT_FLOATS = ("reward", "duration_s")
_ROLLOUT_TIMES = ("started_at", "ended_at")
_ROLLOUT_JSON = ("reward_info",)
_ROLLOUT_BOOLS = ("eval",)


def _timestamp(v: Any, what: str) -> datetime | None:
    if v is None:
        return None
    if isinstance(v, str):
        try:
            t = datetime.fromisoformat(v)
        except ValueError as exc:
            raise BadValue(f"{what}={v!r} is not an ISO 8601 time") from exc
        return t if t.tzinfo is not None else t.replace(tzinfo=UTC)
    s = epoch_s(v, what)
    assert s is not None
    return datetime.fromtimestamp(s, UTC)


def rollout_row(row: dict[str, Any]) -> dict[str, Any]:
    """A result line as a ``rollouts`` row, every field checked against schemas.ROLLOUTS."""
    out: dict[str, Any] = {}
    for f in schemas.ROLLOUTS:
        name, v = f.name, row.get(f.name)
        what = f"rollout {name}"
        if name in _ROLLOUT_INTS:
            v = int_value(v, what, *_ROLLOUT_INTS[name])
        elif name in _ROLLOUT_FLOATS:
            v = float_value(v, what)
        elif name in _ROLLOUT_TIMES:
            v = _timestamp(v, what)
        elif name in _ROLLOUT_JSON:
            v = v if v is None or isinstance(v, str) else orjson.dumps(v).decode()
        elif name in _ROLLOUT_BOOLS:
            v = bool_value(v, what)
        elif v is not None and not isinstance(v, str):
            raise BadValue(f"{what} is a {type(v).__name__}, not a string")
        if v is None and not f.nullable:
            raise BadValue(f"{what} is missing")
        out[name] = v
    return out
