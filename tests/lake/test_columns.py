"""Landing builds model_calls rows by column name: each record becomes the values of its columns
(clawpipe.lake.records), buffered per partition and made into Arrow once per batch (clawpipe.lake.columns),
where the batch is checked against schemas.MODEL_CALLS. A bad list value rejects its call alone."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from clawpipe import capture, schemas
from clawpipe.errors import LakeError
from clawpipe.lake import records, rows
from clawpipe.lake.columns import CallColumns
from tests.lake import fixtures as fx


def _values(api: str = "chat", stream: bool = False, c: fx.Completion | None = None, **hdr: Any) -> records.CallValues:
    header = msgspec.json.decode(
        msgspec.json.encode(fx.header(api=api, stream=stream, **hdr)), type=capture.CaptureHeader
    )
    return records.call_values(header, fx.request_body(api, stream), fx.response_body(api, stream, c), "seg-1", 40)


def test_a_batch_is_every_schema_column_by_name_in_schema_order() -> None:
    cols = CallColumns()
    for i, api in enumerate(("chat", "messages", "responses", "completions")):
        v = _values(
            api, stream=i % 2 == 1, call_id=f"c{i}", c=fx.Completion(ids=[5 + i, 6, 7], logprobs=[-0.5, -1.0, -i])
        )
        cols.add(f"c{i}", v.call, v.choices)
    table = cols.table()
    assert table.schema == schemas.MODEL_CALLS
    got = table.to_pylist()
    assert [r["call_id"] for r in got] == ["c0", "c1", "c2", "c3"]
    assert [r["api"] for r in got] == ["chat", "messages", "responses", "completions"]
    assert [r["completion_token_ids"] for r in got] == [[5, 6, 7], [6, 6, 7], [7, 6, 7], [8, 6, 7]]
    assert [r["completion_logprobs"] for r in got] == [[-0.5, -1.0, -i] for i in range(4)]
    assert all(r["prompt_token_ids"] == [101, 102, 103, 104] for r in got)
    assert [r["segment"] for r in got] == ["seg-1"] * 4 and [r["offset"] for r in got] == [40] * 4
    assert got[0]["request"] == fx.request_body("chat", False).decode()
    assert (
        got[0]["response"]
        == fx.response_body("chat", False, fx.Completion(ids=[5, 6, 7], logprobs=[-0.5, -1.0, 0])).decode()
    )


def test_a_row_that_lacks_a_column_or_names_one_the_schema_lacks_fails_the_batch_naming_it() -> None:
    cols = CallColumns()
    v = _values(call_id="c0")
    del v.call["seq"]
    cols.add("c0", v.call, v.choices)
    with pytest.raises(LakeError, match="seq"):
        cols.table()
    cols = CallColumns()
    v = _values(call_id="c1")
    v.choices[0]["surprise"] = 1
    cols.add("c1", v.call, v.choices)
    with pytest.raises(LakeError, match="surprise"):
        cols.table()


def test_an_id_past_int32_rejects_its_call_there_and_leaves_nothing_of_it_behind() -> None:
    cols = CallColumns()
    good = _values(call_id="good", c=fx.Completion(ids=[1, 2, 3]))
    cols.add("good", good.call, good.choices)
    # the prompt ids fit and go in first; the completion ids do not: neither may stay
    bad = _values(call_id="bad", c=fx.Completion(ids=[1, 2**31, 3]))
    with pytest.raises(rows.BadValue, match=r"completion_token_ids: id 2147483648 at position 1"):
        cols.add("bad", bad.call, bad.choices)
    after = _values(call_id="after", c=fx.Completion(ids=[9]))
    cols.add("after", after.call, after.choices)
    got = cols.table().to_pylist()
    assert [r["call_id"] for r in got] == ["good", "after"]
    assert [r["completion_token_ids"] for r in got] == [[1, 2, 3], [9]]
    assert [r["prompt_token_ids"] for r in got] == [[101, 102, 103, 104]] * 2
    assert [len(r["response"]) for r in got] == [
        len(fx.response_body("chat", False, c)) for c in (fx.Completion(ids=[1, 2, 3]), fx.Completion(ids=[9]))
    ]


def test_values_that_fit_no_column_are_found_once_per_batch_and_only_their_calls_are_left_out() -> None:
    cols = CallColumns()
    for i, (ids, lps) in enumerate(
        [([1, 2], [-0.1, -0.2]), ([3, -4], [-0.1, -0.2]), ([5, 6], [-0.1, -1e39]), ([7], [-0.3])]
    ):
        v = _values(call_id=f"c{i}", c=fx.Completion(ids=ids, logprobs=lps, pieces=["x"] * len(ids)))
        cols.add(f"c{i}", v.call, v.choices)
    with pytest.raises(rows.BadRows) as exc:
        cols.table()
    assert exc.value.bad == {
        1: "completion_token_ids: id -4 at position 1 is outside [0, 2147483647]",
        2: "completion_logprobs: logprob -1e+39 at position 1 is not a finite float32",
    }
    got = cols.table(drop={1, 2}, blank=set(exc.value.bad)).to_pylist()
    assert [(r["call_id"], r["completion_token_ids"]) for r in got] == [("c0", [1, 2]), ("c3", [7])]


def test_the_next_batch_reuses_the_body_buffer_only_once_nothing_views_it() -> None:
    cols = CallColumns()
    v = _values(call_id="a", c=fx.Completion(ids=[1]))
    cols.add("a", v.call, v.choices)
    held = cols.table()  # a table still alive views the buffer: the next batch must not write into it
    before = held.column("response").to_pylist()
    nxt = cols.emptied()
    assert nxt.texts["response"].buf is not cols.texts["response"].buf
    w = _values(call_id="b", c=fx.Completion(ids=[2, 3], logprobs=[-1.0, -2.0], pieces=["x", "y"]))
    nxt.add("b", w.call, w.choices)
    nxt.table()
    assert held.column("response").to_pylist() == before
    del held
    again = nxt.emptied()  # that table is gone: its buffer is reused, and reads what the new batch wrote
    assert again.texts["response"].buf is nxt.texts["response"].buf
    u = _values(call_id="c", c=fx.Completion(ids=[4]))
    again.add("c", u.call, u.choices)
    assert again.table().column("response").to_pylist() == [
        fx.response_body("chat", False, fx.Completion(ids=[4])).decode()
    ]
