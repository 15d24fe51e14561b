"""Values for the lake's columns, checked: every value of a record fits its column's type and range, or the
record is a reject with a reason naming the column (one bad value never stops a landing).

Scalars are checked per record as they are read (:func:`int_value`, :func:`float_value`, ...). Token-id
and logprob lists have their element types checked per record where no typed decoder has done it
already (:func:`id_list`, :func:`logprob_list`); ids outside int32 and logprobs that are not finite
float32 are looked for once per row group over the whole column (:mod:`clawpipe.lake.columns`): a row
group with a bad list falls back to finding its rows, which become rejects, and the rest is written.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from typing import Any

import msgspec
import numpy as np
import orjson

from clawpipe import schemas
from clawpipe.capture import EPOCH_MAX_S, INT32_MAX, INT64_MAX, RUN_ID_MAX, SAFE_RUN_ID

__all__ = ["EPOCH_MAX_S", "INT32_MAX", "INT64_MAX"]  # the column ranges, shared with the capture header

_SAFE_PART = re.compile(SAFE_RUN_ID)


class BadValue(ValueError):
    """A value that does not fit its column: the record becomes a reject with this message."""


def partition_name(value: Any, what: str) -> str:
    """A run id that names a partition directory (``run_id=<value>``): a non-empty string of letters, digits
    and ``._:@+-`` (no path separator, no leading dot), at most RUN_ID_MAX characters."""
    if not isinstance(value, str) or not value:
        raise BadValue(f"{what} missing or not a string")
    if len(value) > RUN_ID_MAX:
        raise BadValue(f"{what} is {len(value)} characters long, longer than {RUN_ID_MAX}")
    if not _SAFE_PART.match(value):
        raise BadValue(f"{what} {value!r} is not usable as a partition name (letters, digits, ._:@+-)")
    return value


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


def id_list(v: Any, what: str, typed: bool) -> list[int] | np.ndarray | None:
    """A token-id list with its elements checked to be ints (not bools, floats or text) unless a typed
    decoder did that; whether they fit int32 is checked per row group (:mod:`clawpipe.lake.columns`)."""
    if v is None or typed or isinstance(v, np.ndarray):  # the large-body path parsed these with NumPy
        return v
    try:
        return msgspec.convert(v, list[int])
    except msgspec.ValidationError as exc:
        raise BadValue(f"{what}: {exc}") from exc


def logprob_list(v: Any, what: str, typed: bool) -> list[float] | np.ndarray | None:
    """A logprob list with its elements checked to be numbers unless a typed decoder did that; whether they
    fit float32 (finite) is checked per row group."""
    if v is None or typed or isinstance(v, np.ndarray):
        return v
    try:
        return msgspec.convert(v, list[float])
    except msgspec.ValidationError as exc:
        raise BadValue(f"{what}: {exc}") from exc


class BadRows(Exception):
    """Rows of a batch whose values do not fit: {row index: reason}."""

    def __init__(self, bad: dict[int, str]) -> None:
        super().__init__(f"{len(bad)} bad rows")
        self.bad = bad


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
