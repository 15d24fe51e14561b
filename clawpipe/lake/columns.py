"""The row layout of ``model_calls``: one partition's buffered rows, column by column, under the column names
of :data:`clawpipe.schemas.MODEL_CALLS`.

Landing hands each call over as a mapping of column name to value for the call (the same in every row
of it) and one such mapping per choice (:meth:`CallColumns.add`). A batch of rows becomes Arrow once
(:meth:`CallColumns.table`), column by column: each column is the values its name holds in every row,
and the batch is checked against the schema there (every row names each column once, each column of
the schema's type). Token-id and logprob lists go into one flat typed buffer per column as each call is
added (an id past int32 makes that call a reject there), with no per-row array or Python numbers held;
ids below 0 and logprobs that are not finite float32 are looked for per batch, once over each whole
column. A row that fails names its column and is reported through :class:`rows.BadRows` (its call
becomes a reject, the rest is written).
"""

from __future__ import annotations

import array
from collections.abc import Collection, Mapping, Sequence
from operator import itemgetter
from typing import Any

import numpy as np
import pyarrow as pa

from clawpipe import schemas
from clawpipe.errors import LakeError
from clawpipe.lake import rows

SCHEMA = schemas.MODEL_CALLS
LIST_COLUMNS = frozenset(f.name for f in SCHEMA if pa.types.is_list(f.type))
TEXT_COLUMNS = frozenset({"request", "response"})  # the captured bodies: bytes until the Arrow column
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class ListColumn:
    """A list column, flat: the values of every row end to end in one typed buffer (4 bytes an id, 8 a
    logprob: no Python number is held past its record), each row's length, and its null rows."""

    def __init__(self, name: str, ids: bool) -> None:
        self.name, self.ids = name, ids
        self.buf = array.array(_INT32 if ids else "d")
        self.lengths: list[int] = []
        self.nulls: list[int] = []

    def add(self, v: list[Any] | np.ndarray | None) -> None:
        """Append one row's list (its elements checked to be numbers already); raises :class:`rows.BadValue`
        for an id outside int32, leaving the column as it was."""
        if v is None:
            self.nulls.append(len(self.lengths))
            self.lengths.append(0)
            return
        n = len(self.buf)
        try:
            if v.__class__ is list:
                self.buf.fromlist(v)
            elif v.__class__ is array.array and v.typecode == self.buf.typecode:
                self.buf.extend(v)  # the compiled reader's (ids in int32 already): one copy
            else:  # a NumPy array (large bodies), or another typed array: checked whole, then copied in
                arr = np.asarray(v)
                if self.ids and len(arr) and (arr.min() < -(2**31) or arr.max() > rows.INT32_MAX):
                    raise OverflowError
                self.buf.frombytes(arr.astype(self.buf.typecode).data.cast("B"))  # no bytes copy
        except OverflowError:
            del self.buf[n:]
            raise rows.BadValue(f"{self.name}: {_problem(v, self.ids)}") from None
        self.lengths.append(len(v))

    def truncate(self, n_rows: int) -> None:
        """Drop the rows from ``n_rows`` on (a call that turned out to be a reject)."""
        del self.buf[len(self.buf) - sum(self.lengths[n_rows:]) :], self.lengths[n_rows:]
        self.nulls = [r for r in self.nulls if r < n_rows]

    def offsets(self) -> np.ndarray:
        out = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=out[1:])
        return out

    def array(self, blank: Collection[int] = ()) -> pa.Array:
        """The column as list<int32> or list<float32>; raises :class:`rows.BadRows` for rows with an id below 0
        or a logprob that is not a finite float32 (the rows in ``blank``, already rejected, are left out)."""
        values = np.frombuffer(self.buf, dtype=np.int32 if self.ids else np.float64)
        offsets = self.offsets()
        if blank:
            values = values.copy()
            for row in blank:
                values[offsets[row] : offsets[row + 1]] = 0
        bad = _out_of_range(values, self.ids)
        if bad.size:
            raise rows.BadRows(self._bad_rows(values, offsets, bad))
        if not self.ids:
            values = values.astype(np.float32)
        mask = None
        if self.nulls:
            m = np.zeros(len(self.lengths), dtype=bool)
            m[self.nulls] = True
            mask = pa.array(m)
        value_type = pa.int32() if self.ids else pa.float32()
        return pa.ListArray.from_arrays(
            pa.array(offsets.astype(np.int32)), pa.array(values, type=value_type), mask=mask
        )

    def _bad_rows(self, values: np.ndarray, offsets: np.ndarray, bad: np.ndarray) -> dict[int, str]:
        """The rows holding the ``bad`` positions, each with its first bad value."""
        out: dict[int, str] = {}
        for pos in bad.tolist():
            row = int(np.searchsorted(offsets, pos, side="right")) - 1
            if row not in out:
                out[row] = f"{self.name}: {_problem(values[offsets[row] : offsets[row + 1]], self.ids)}"
        return out


_INT32 = next(code for code in "ilh" if array.array(code).itemsize == 4)  # C int on every platform we run on


def _out_of_range(values: np.ndarray, ids: bool) -> np.ndarray:
    if ids:
        return np.flatnonzero(values < 0)  # int32 already: nothing above it
    return np.flatnonzero(~(np.abs(values) <= _FLOAT32_MAX))  # NaN compares False: caught too


def _problem(part: Any, ids: bool) -> str:
    """What is wrong with one row's list (the first bad value and its position)."""
    if ids:
        for k, v in enumerate(part):
            if not 0 <= v <= rows.INT32_MAX:
                return f"id {int(v)} at position {k} is outside [0, {rows.INT32_MAX}]"
        return "ids outside int32"
    for k, v in enumerate(part):
        if not abs(v) <= _FLOAT32_MAX:
            return f"logprob {float(v)} at position {k} is not a finite float32"
    return "logprobs that are not finite float32"


class TextColumn:
    """A string column of captured bodies (request, response), flat: the bodies end to end in one buffer,
    each row's length, and its null rows.

    Each body is copied in as its call is added (still in cache, and the body object is freed at once), into
    the buffer the partition's previous row group used (:meth:`reuse`): on this kind of machine a freshly
    allocated page costs more than the copy, and a row group would otherwise touch its bodies' worth of
    fresh pages twice (the bodies held, then joined). Bodies that do not fit (the first row group, or a
    larger one) are held and joined with the buffer once, into a buffer of the new size."""

    def __init__(self, name: str, buf: bytearray | None = None) -> None:
        self.name = name
        self.buf = buf if buf is not None else bytearray()
        self.end = 0  # bytes of ``buf`` in use
        self.spill: list[bytes | memoryview] = []  # bodies after those in ``buf`` (it was full)
        self.lengths: list[int] = []
        self.nulls: list[int] = []

    def add(self, v: bytes | memoryview | None) -> None:
        if v is None:
            self.nulls.append(len(self.lengths))
            self.lengths.append(0)
            return
        start, n = self.end, len(v)
        if not self.spill and start + n <= len(self.buf):
            self.buf[start : start + n] = v  # same length: a copy in place, never a resize
            self.end = start + n
        else:
            self.spill.append(v)
        self.lengths.append(n)

    def truncate(self, n_rows: int) -> None:
        """Drop the rows from ``n_rows`` on (a call that turned out to be a reject)."""
        nulls = set(self.nulls)
        for row in range(len(self.lengths) - 1, n_rows - 1, -1):
            if row in nulls:
                continue
            if self.spill:
                self.spill.pop()
            else:
                self.end -= self.lengths[row]
        del self.lengths[n_rows:]
        self.nulls = [r for r in self.nulls if r < n_rows]

    def _data(self) -> bytearray:
        """The buffer holding every body (the spilled ones joined in: one copy)."""
        if self.spill:
            self.buf = bytearray().join([memoryview(self.buf)[: self.end], *self.spill])
            self.end, self.spill = len(self.buf), []
        return self.buf

    def value(self, row: int) -> bytes | None:
        if row in self.nulls:
            return None
        start = sum(self.lengths[:row])
        return bytes(self._data()[start : start + self.lengths[row]])

    def reuse(self) -> bytearray | None:
        """The buffer, for the next row group, once nothing made from it is alive (else None: a fresh one).

        Arrow columns made by :meth:`array` view the buffer without a copy; while one lives, the buffer
        cannot be resized, which is how a view still held is told apart (writing into it would change a
        column someone still reads). The probe shrinks and regrows it by one byte: never a reallocation."""
        buf = self.buf
        if not buf:
            return None
        try:
            last = buf.pop()
            buf.append(last)
        except BufferError:
            return None
        return buf

    def array(self) -> pa.Array:
        """The column as Arrow strings viewing the buffer (no copy), UTF-8 checked once over all of it; a
        body that is not UTF-8 is kept as far as it reads."""
        data = self._data()
        if self.end > rows.INT32_MAX:  # past 32-bit offsets: let Arrow chunk it
            return pa.array([self.value(i) for i in range(len(self.lengths))], type=pa.binary()).cast(pa.string())
        offsets = np.zeros(len(self.lengths) + 1, dtype=np.int32)
        np.cumsum(self.lengths, out=offsets[1:])
        validity = None
        if self.nulls:
            m = np.ones(len(self.lengths), dtype=bool)
            m[self.nulls] = False
            validity = pa.array(m).buffers()[1]
        view = pa.py_buffer(memoryview(data)[: self.end])
        arr = pa.Array.from_buffers(
            pa.string(), len(self.lengths), [validity, pa.py_buffer(offsets), view], null_count=-1
        )
        try:
            arr.validate(full=True)
        except pa.ArrowInvalid:  # not UTF-8: keep what can be read
            values = [self.value(i) for i in range(len(self.lengths))]
            return pa.array([None if v is None else v.decode("utf-8", "replace") for v in values], pa.string())
        return arr


class CallColumns:
    """One partition's buffered ``model_calls`` rows: each row the mapping of its call (the values every
    choice shares) and the mapping of its choice, both keyed by column name, except the list and body
    columns, whose values move into flat columns (:class:`ListColumn`, :class:`TextColumn`) as the call is
    added; the other columns are made per batch, by name."""

    def __init__(self, buffers: Mapping[str, bytearray] | None = None) -> None:
        self.lists = {name: ListColumn(name, SCHEMA.field(name).type.value_type == pa.int32()) for name in LIST_COLUMNS}
        self.texts = {name: TextColumn(name, (buffers or {}).get(name)) for name in TEXT_COLUMNS}
        self.row_call: list[Mapping[str, Any]] = []  # per row: its call's mapping (shared by its choices)
        self.row_choice: list[Mapping[str, Any]] = []  # per row: its choice's mapping
        self.call_ids: list[str] = []  # one per call, in order
        self.call_rows: list[int] = []  # rows of each call (its choices)

    def __len__(self) -> int:
        return len(self.call_ids)

    def add(self, call_id: str, call: dict[str, Any], choices: list[dict[str, Any]]) -> None:
        """Append one call: ``call`` holds the values every row of it shares, ``choices`` one mapping per
        row (choice) with the rest; the values are checked already, but for the range of ids (raises
        :class:`rows.BadValue`, adding nothing). Together the two name every column once (checked per batch,
        :meth:`table`); the list and body columns' values are taken out of the mappings into the flat columns."""
        n_rows = len(self.row_call)
        try:
            for choice in choices:
                for name, col in self.lists.items():
                    col.add(choice.pop(name))
                for name, text in self.texts.items():
                    text.add(call[name])
            for name in self.texts:  # every row holds the same body: it is in the buffer now
                del call[name]
        except (KeyError, rows.BadValue) as exc:
            flats: list[ListColumn | TextColumn] = [*self.lists.values(), *self.texts.values()]
            for flat in flats:  # nothing of the call stays
                flat.truncate(n_rows)
            if isinstance(exc, KeyError):
                raise LakeError(
                    f"landing rows lack the model_calls column {exc.args[0]} (clawpipe/schemas.py)"
                ) from None
            raise
        for choice in choices:
            self.row_call.append(call)
            self.row_choice.append(choice)
        self.call_ids.append(call_id)
        self.call_rows.append(len(choices))

    def emptied(self) -> CallColumns:
        """Empty columns for the next batch, reusing this batch's body buffers where nothing made from them
        is alive any more (call once its table is written and dropped)."""
        kept = {name: text.reuse() for name, text in self.texts.items()}
        return CallColumns({name: buf for name, buf in kept.items() if buf is not None})

    def row_calls(self) -> np.ndarray:
        """Index of the call of every row."""
        return np.repeat(np.arange(len(self.call_rows)), self.call_rows)

    def value(self, name: str, row: int) -> Any:
        """One buffered value (for a reject's preview)."""
        if name in self.texts:
            return self.texts[name].value(row)
        call = self.row_call[row]
        return call[name] if name in call else self.row_choice[row][name]

    def columns(self) -> dict[str, Sequence[Any]]:
        """Column name -> the values of every row, after checking that each row names every column once."""
        call_keys, choice_keys = _layout(self.row_call, "call"), _layout(self.row_choice, "choice")
        flat = LIST_COLUMNS | TEXT_COLUMNS
        names = call_keys | choice_keys | flat
        twice = (call_keys & choice_keys) | ((call_keys | choice_keys) & flat)
        if twice or names != _NAMES:
            raise LakeError(
                f"landing rows name columns {sorted(names)}, model_calls has {sorted(_NAMES)} "
                f"(twice: {sorted(twice)}); see clawpipe/schemas.py"
            )
        cols: dict[str, Sequence[Any]] = {}
        for keys, rows_ in ((sorted(call_keys), self.row_call), (sorted(choice_keys), self.row_choice)):
            if len(keys) == 1:
                cols[keys[0]] = [r[keys[0]] for r in rows_]
            elif keys:  # transposed by name in C: each row's values fetched by the column names, then zipped
                cols.update(zip(keys, zip(*map(itemgetter(*keys), rows_), strict=True), strict=True))
        return cols

    def table(self, drop: Collection[int] = (), blank: Collection[int] = ()) -> pa.Table:
        """The buffered rows as Arrow, checked against the schema, less the calls at the indices in ``drop``.

        Raises :class:`rows.BadRows` ({row: reason}) for rows whose lists do not fit, leaving out of that
        check the rows in ``blank`` (whose calls are in ``drop``: rejected already).
        """
        cols = self.columns()
        arrays: list[pa.Array] = []
        bad: dict[int, str] = {}
        for f in SCHEMA:
            if f.name in LIST_COLUMNS:
                try:
                    arrays.append(self.lists[f.name].array(blank))
                except rows.BadRows as exc:
                    for i, reason in exc.bad.items():
                        bad.setdefault(i, reason)
            elif f.name in TEXT_COLUMNS:
                arrays.append(self.texts[f.name].array())
            else:
                arrays.append(_scalar_array(f, cols[f.name]))
        if bad:
            raise rows.BadRows(bad)
        table = pa.Table.from_arrays(arrays, schema=SCHEMA)
        if drop:
            dropped = np.zeros(len(self.call_ids), dtype=bool)
            dropped[list(drop)] = True
            table = table.filter(pa.array(~dropped[self.row_calls()]))
        return table


_NAMES = frozenset(SCHEMA.names)


def _layout(mappings: list[Mapping[str, Any]], what: str) -> frozenset[str]:
    """The column names every one of ``mappings`` holds (all alike, else a landing bug)."""
    if not mappings:
        return frozenset()
    keys = mappings[0].keys()
    for m in mappings:
        if m.keys() != keys:
            raise LakeError(f"landing {what} rows name different columns: {sorted(keys)} and {sorted(m.keys())}")
    return frozenset(keys)


def _scalar_array(f: pa.Field, values: Sequence[Any]) -> pa.Array:
    if pa.types.is_timestamp(f.type):
        return pa.array(values, type=pa.int64()).view(f.type)
    return pa.array(values, type=f.type)
