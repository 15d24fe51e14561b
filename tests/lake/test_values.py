"""One bad value never stops a landing: every field of a capture header, of a response's token fields and
of a rollout row is tried with out-of-range numbers, wrong types and non-finite values. Each bad record
is exactly one reject naming the field; every other record lands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clawpipe import capture
from clawpipe.lake import land, run_sql
from tests.lake import fixtures as fx

NAN, INF = float("nan"), float("inf")
BIG = 10**30
OUT_OF_RANGE_INTS = [-1, 2**31, 2**40, 2**63, BIG, -(2**63) - 1]
WRONG_TYPES = ["x", 1.5, True, [1], {"a": 1}]
NOT_FINITE = [NAN, INF, -INF]
ANY_VALUE = [None, "x", 3, 1.5, True, [1, 2], {"a": [1]}, BIG, -1]

_NONE_LANDS = {"lands": [None]}


def _int_field(lo_ok: int = 0, *, optional: bool = True) -> dict[str, list[Any]]:
    bad = [v for v in OUT_OF_RANGE_INTS if v < 0 or v > 2**31 - 1] + WRONG_TYPES + ["1e3"]
    if lo_ok < 0:
        bad = [v for v in bad if v != -1]
    ok: list[Any] = [0, 7, str(5), 3.0]
    return {"reject": bad + ([] if optional else [None]), "lands": ok + ([None] if optional else [])}


def _int64_field() -> dict[str, list[Any]]:
    return {
        "reject": [-1, 2**63, BIG, *WRONG_TYPES],
        "lands": [None, 0, 2**40, 2**63 - 1],
    }


_FLOAT = {"reject": [*NOT_FINITE, "x", True, [1.0]], "lands": [None, 0.5, 3, "2.5"]}
_EPOCH = {"reject": [*NOT_FINITE, -1.0, 1e30, "x", True, [1.0]], "lands": [None, 1_700_000_000.5, 0]}
_TEXT = {"reject": [], "lands": ANY_VALUE}
_PART = {"reject": [None, "", 5, [1], {"a": 1}], "lands": ["x-1"]}

HEADER_CASES: dict[str, dict[str, list[Any]]] = {
    "call_id": {"reject": [None, "", 5, [1], {"a": 1}], "lands": []},  # ids vary per record: see _header_record
    "run_id": {**_PART, "reject": [*_PART["reject"], "a/b", "../x"]},
    "iteration": _int_field(optional=False),
    "rollout_id": _PART,
    "seq": _int64_field(),
    "api": {"reject": [], "lands": [None, "models", 5]},
    "method": _TEXT,
    "path": _TEXT,
    "query": _TEXT,
    "stream": {"reject": ["yes", 1, [True]], "lands": [None, False]},
    "http_status": {"reject": [-1, 1000, 2**40, BIG, "x", True, 1.5], "lands": [None, 200, "200"]},
    "status": {"reject": ["weird", 5, ["ok"]], "lands": [None, "ok"]},
    "error": _TEXT,
    "model": _TEXT,
    "policy_version": _int64_field(),
    "t_start": _EPOCH,
    "t_end": _EPOCH,
    "upstream_ms": _FLOAT,
    "request_changes": {"reject": [], "lands": ANY_VALUE},
    "token_source": {"reject": ["weird", 5], "lands": [None, "upstream", "none"]},
    "retokenized": {"reject": [], "lands": ANY_VALUE},  # read only when token_source is retokenized
    "upstream": _TEXT,
}


def test_every_header_field_is_covered() -> None:
    assert set(HEADER_CASES) == set(capture.HEADER_FIELDS)


def _encode(header: dict[str, Any], response: bytes) -> bytes:
    # json.dumps writes NaN/Infinity as the proxy's json.dumps would: not JSON, so the record is a reject
    return capture.encode_record(header, fx.request_body("chat", False), response)


def _header_record(field: str, value: Any, call_id: str) -> bytes:
    h = fx.header(call_id=call_id)
    if value is _MISSING:
        del h[field]
    else:
        h[field] = value
    return _encode(h, fx.response_body("chat", False))


_MISSING = object()


def _response_cases() -> list[tuple[str, str, Any, str]]:
    """(case id, where, value, expected) over the response's token fields."""
    ids_bad = [2**31, -1, BIG, 1.5, "5", True, None, [1], {"a": 1}]
    cases = []
    for where in ("prompt_token_ids", "token_ids"):
        for v in ids_bad:
            cases.append((f"{where}[1]={v!r}", where, v, "reject"))
        cases += [(f"{where}=str", f"{where}=", "abc", "reject"), (f"{where}=2**31", f"{where}=", [2**31], "reject")]
    for v in ["x", True, None, 1e300, -1e39, [1.0]]:
        cases.append((f"logprob={v!r}", "logprob", v, "reject"))
    cases.append(("logprob=int", "logprob", -2, "lands"))
    for key in ("prompt_tokens", "completion_tokens"):
        for v in [2**40, 2**31, -1, "x", 1.5, True, [1]]:
            cases.append((f"usage.{key}={v!r}", f"usage.{key}", v, "reject"))
        cases += [
            (f"usage.{key}='4'", f"usage.{key}", "4", "lands"),
            (f"usage.{key}=None", f"usage.{key}", None, "lands"),
        ]
    for v in [2**31, -1, "x", True]:
        cases.append((f"index={v!r}", "index", v, "reject"))
    for v in [BIG, -1, "x", 1.5, True]:
        cases.append((f"policy_version={v!r}", "policy_version", v, "reject"))
    cases.append(("finish_reason=7", "finish_reason", 7, "lands"))
    return cases


def _response(where: str, value: Any) -> bytes:
    body = json.loads(fx.response_body("chat", False))
    choice = body["choices"][0]
    if where in ("prompt_token_ids", "token_ids"):
        target = body["prompt_token_ids"] if where == "prompt_token_ids" else choice["token_ids"]
        target[1] = value
    elif where.endswith("="):
        (body if where.startswith("prompt") else choice)[where[:-1]] = value
    elif where == "logprob":
        choice["logprobs"]["content"][1]["logprob"] = value
    elif where.startswith("usage."):
        body["usage"][where[6:]] = value
    elif where in ("index", "finish_reason"):
        choice[where] = value
    else:
        body[where] = value
    return json.dumps(body).encode()


ROLLOUT_CASES: dict[str, dict[str, list[Any]]] = {
    "rollout_id": _PART,
    "run_id": {**_PART, "reject": [*_PART["reject"], "a/b", "../x", "r" * 201], "lands": ["r" * 200]},
    "iteration": _int_field(optional=False),
    "group_id": {"reject": [5, [1]], "lands": [None, "g"]},
    "harness": {"reject": [5, {"a": 1}], "lands": [None]},
    "task_set": {"reject": [True], "lands": [None]},
    "task_id": {"reject": [1.5], "lands": [None]},
    "sample_idx": _int_field(),
    "backend": {"reject": [[1]], "lands": [None]},
    "status": {"reject": [5], "lands": ["failed"]},
    "exit_code": {"reject": [2**31, BIG, "x", True, 1.5], "lands": [None, -9, 0, 2**31 - 1]},
    "reward": {**_FLOAT, "lands": [None, 0.5, 1, -1.0]},
    "reward_info": {"reject": [], "lands": ANY_VALUE},
    "n_calls": _int_field(),
    "started_at": {"reject": ["yesterday", 1e30, -1, True, [1]], "lands": [None, 1_700_000_000, "2026-01-01T00:00:00"]},
    "ended_at": {"reject": ["2026-13-01", NAN], "lands": [None]},
    "duration_s": _FLOAT,
    "stderr_tail": {"reject": [5], "lands": [None, ""]},
    "error": {"reject": [{"a": 1}], "lands": [None, "boom"]},
    "attempt": _int_field(),
    "policy_version": _int64_field(),
    "eval": {"reject": ["no", 1, [True]], "lands": [None, True, False]},
}


def test_every_rollout_field_is_covered() -> None:
    from clawpipe import schemas

    assert set(ROLLOUT_CASES) == set(schemas.ROLLOUTS.names)


def _outcomes(lake: Path) -> tuple[set[str], dict[tuple[str, int], str]]:
    calls = {
        cid
        for p in (lake / "model_calls").rglob("*.parquet")
        for cid in pq.read_table(p, columns=["call_id"]).column(0).to_pylist()
    }
    rejects = {
        (r["source"], r["offset"]): r["reason"]
        for p in (lake / "rejects").rglob("*.parquet")
        for r in pq.read_table(p, columns=["source", "offset", "reason"]).to_pylist()
    }
    return calls, rejects


def test_capture_fields_bad_values_are_one_reject_each(tmp_path: Path) -> None:
    """One segment: each case between good records, landed in one run."""
    frames: list[bytes] = []
    cases: list[tuple[str, int, str, str, str]] = []  # (case, offset, expected, field named in the reason, call id)
    goods: list[str] = []

    def add(frame: bytes, case: str, outcome: str, named: str, call_id: str) -> None:
        goods.append(f"good-{len(cases)}")
        frames.append(fx.record(call_id=goods[-1], seq=len(cases)))
        cases.append((case, sum(map(len, frames)), outcome, named, call_id))
        frames.append(frame)

    for field, outcomes in HEADER_CASES.items():
        for outcome, values in outcomes.items():
            for v in values:
                cid = f"h-{len(cases)}"
                add(_header_record(field, v, cid), f"header {field}={v!r}", outcome, field, cid)
        if field not in ("retokenized", "method", "query", "upstream", "error", "model", "path", "api"):
            cid = f"h-{len(cases)}"
            outcome = "lands" if None in outcomes["lands"] else "reject"
            add(_header_record(field, _MISSING, cid), f"header {field} missing", outcome, field, cid)
    for case, where, value, outcome in _response_cases():
        cid = f"r-{len(cases)}"
        named = where.rstrip("=").split(".")[-1]
        add(_encode(fx.header(call_id=cid), _response(where, value)), f"response {case}", outcome, named, cid)
    for v in [[2**31], [-1], ["x"], [1.5], "abc"]:  # retokenized ids in the header, read when token_source says so
        cid = f"t-{len(cases)}"
        h = fx.header(call_id=cid, token_source="retokenized", retokenized={"prompt_token_ids": v, "choices": []})
        add(
            _encode(h, fx.response_body("chat", False)),
            f"retokenized prompt ids {v!r}",
            "reject",
            "prompt_token_ids",
            cid,
        )
    frames.append(fx.record(call_id="last", seq=10**6))
    goods.append("last")
    fx.write_segment(tmp_path / "cap" / "v-1.seg", frames)
    rep = land(tmp_path / "cap", tmp_path / "lake")
    calls, rejects = _outcomes(tmp_path / "lake")
    assert set(goods) <= calls, "every good record lands"
    wrong = []
    for case, offset, outcome, named, cid in cases:
        landed, reason = cid in calls, rejects.get(("v-1", offset))
        if landed and reason is not None:
            wrong.append(f"{case}: landed AND rejected")
        elif outcome == "reject" and reason is None:
            wrong.append(f"{case}: not rejected")
        elif outcome == "lands" and not landed:
            wrong.append(f"{case}: not landed ({reason})")
        elif reason is not None and named not in reason and "undecodable" not in reason:
            wrong.append(f"{case}: the reason does not name {named}: {reason}")
    assert not wrong, "\n".join(wrong)
    n_reject = sum(1 for c in cases if c[2] == "reject")
    assert rep.rejects == n_reject == len(rejects)
    assert rep.calls == len(calls) == len(goods) + len(cases) - n_reject


def test_rollout_fields_bad_values_are_one_reject_each(tmp_path: Path) -> None:
    rows: list[dict[str, Any]] = []
    expected: list[tuple[str, str, str]] = []  # (case, rollout id, outcome)
    for field, outcomes in ROLLOUT_CASES.items():
        for outcome, values in outcomes.items():
            for v in values:
                rid = f"ro-{len(expected)}"
                row = fx.rollout_row(rid)
                row[field] = v
                rows.append(row)
                expected.append((f"{field}={v!r}", rid, outcome))
                rows.append(fx.rollout_row(f"good-{len(expected)}"))
    path = tmp_path / "cap" / "results" / "results-x.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rep = land(tmp_path / "cap", tmp_path / "lake")
    landed = set(run_sql(tmp_path / "lake", "select rollout_id from rollouts").column(0).to_pylist())
    reasons = run_sql(tmp_path / "lake", "select record, reason from rejects").to_pylist()
    wrong = []
    for case, rid, outcome in expected:
        if (outcome == "lands") != (rid in landed) and not (
            case.startswith(("rollout_id", "run_id")) and outcome == "lands"
        ):
            wrong.append(f"{case}: expected {outcome}")
    assert not wrong, "\n".join(wrong)
    assert all(f"good-{i}" in landed for i in range(1, len(expected) + 1))
    n_reject = sum(1 for e in expected if e[2] == "reject")
    assert rep.rejects == n_reject == len(reasons)
    for r in reasons:
        assert "rollout" in r["reason"] or "bad result line" in r["reason"], r


def _json_values() -> st.SearchStrategy[Any]:
    leaf = st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from([-1, 0, 2**31 - 1, 2**31, 2**40, 2**63, BIG]),  # the edges of int32 and int64
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=8),
    )
    return st.recursive(
        leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=6
    )


_RESPONSE_PATHS = [
    ("prompt_token_ids",),
    ("choices", 0, "token_ids"),
    ("choices", 0, "token_ids", 0),
    ("choices", 0, "logprobs"),
    ("choices", 0, "logprobs", "content", 0, "logprob"),
    ("choices", 0, "index"),
    ("choices", 0, "message"),
    ("choices", 0),
    ("usage", "prompt_tokens"),
    ("usage", "completion_tokens"),
    ("usage",),
    ("policy_version",),
    ("model",),
    ("choices",),
]


def _set(obj: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    header_field=st.sampled_from(capture.HEADER_FIELDS),
    header_value=_json_values(),
    response_path=st.sampled_from(_RESPONSE_PATHS),
    response_value=_json_values(),
)
def test_any_json_value_anywhere_lands_or_is_one_reject(
    tmp_path_factory: pytest.TempPathFactory,
    header_field: str,
    header_value: Any,
    response_path: tuple[Any, ...],
    response_value: Any,
) -> None:
    """Whatever JSON a header field or a response field holds, the record lands or is exactly one reject,
    and the records around it land."""
    work = tmp_path_factory.mktemp("any")
    h = fx.header(call_id="odd")
    h[header_field] = "odd" if header_field == "call_id" and header_value in ("a", "b") else header_value
    body = json.loads(fx.response_body("chat", False))
    _set(body, response_path, response_value)
    frames = [fx.record(call_id="a", seq=0), _encode(h, json.dumps(body).encode()), fx.record(call_id="b", seq=2)]
    fx.write_segment(work / "cap" / "o-1.seg", frames)
    rep = land(work / "cap", work / "lake")
    calls, rejects = _outcomes(work / "lake")
    assert {"a", "b"} <= calls
    assert rep.rejects == len(rejects) <= 1
    assert (len(calls) - 2) + len(rejects) == 1, (calls, rejects)
    if rejects:
        assert list(rejects) == [("o-1", len(frames[0]))]
