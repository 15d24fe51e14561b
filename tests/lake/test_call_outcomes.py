"""What a call's columns say about how it ended, from the shapes the engine (and vLLM) really send: a stream
cut by an error event is not ok; the engine's policy_version wins over the proxy's stamp, mismatches audited;
and the audits that keep these invariants find their offenders."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clawpipe import capture, schemas, tables
from clawpipe.lake import compact, land, run_audits, run_sql
from clawpipe.serving.routes import error_body, sse
from tests.lake import fixtures as fx

SHUTDOWN = "the engine is shutting down; retry the call"


def _cut_by_error(api: str) -> bytes:
    """The stream the engine sends when it stops part-way: what it had streamed, then its error event."""
    body = fx.response_body(api, True)
    events = body.split(b"\n\n")
    if api in ("chat", "completions"):
        kept = [e for e in events[:3] if e]  # the first chunk and two token chunks
        tail = sse(error_body(SHUTDOWN, "api_error", False))
    elif api == "messages":
        kept = [e for e in events[:4] if e]
        tail = sse(error_body(SHUTDOWN, "api_error", True), "error")
    else:
        kept = [e for e in events[:2] if e]
        tail = sse({"type": "error", "code": "server_error", "message": SHUTDOWN, "param": None}, "error")
    return b"\n\n".join(kept) + b"\n\n" + tail


@pytest.mark.parametrize("api", fx.APIS)
def test_stream_ending_in_an_error_event_lands_as_upstream_error(tmp_path: Path, api: str) -> None:
    frames = [
        capture.encode_record(
            fx.header(api=api, stream=True, call_id="cut"), fx.request_body(api, True), _cut_by_error(api)
        ),
        fx.record(api, True, call_id="whole"),
    ]
    fx.write_segment(tmp_path / "cap" / "s-1.seg", frames)
    rep = land(tmp_path / "cap", tmp_path / "lake")
    assert (rep.calls, rep.rejects, rep.stream_errors) == (2, 0, 1)
    rows = {r["call_id"]: r for r in run_sql(tmp_path / "lake", "select * from model_calls").to_pylist()}
    cut, whole = rows["cut"], rows["whole"]
    assert (cut["status"], cut["http_status"]) == ("upstream_error", 200)
    assert SHUTDOWN in cut["error"]
    assert (whole["status"], whole["error"]) == ("ok", None)
    audits = run_audits(tmp_path / "lake")
    assert audits["ok_calls_with_error"].num_rows == 0


def test_vllm_stream_error_shape_is_an_error_too(tmp_path: Path) -> None:
    events = fx.response_body("chat", True).split(b"\n\n")[:2]
    tail = b'data: {"object": "error", "message": "engine dead", "type": "InternalServerError", "code": 500}\n\n'
    body = b"\n\n".join(events) + b"\n\n" + tail
    fx.write_segment(
        tmp_path / "cap" / "v-1.seg",
        [capture.encode_record(fx.header(stream=True, call_id="v"), fx.request_body("chat", True), body)],
    )
    land(tmp_path / "cap", tmp_path / "lake")
    row = run_sql(tmp_path / "lake", "select status, error from model_calls").to_pylist()[0]
    assert row == {"status": "upstream_error", "error": "engine dead"}


def _with_version(api: str, stream: bool, engine: int | None, stamp: int, call_id: str) -> bytes:
    body = fx.response_body(api, stream, fx.Completion(policy_version=engine if engine is not None else 0))
    if engine is None:  # vLLM reports no policy_version: the stamp is all there is
        body = re.sub(rb'"policy_version": 0, |, "policy_version": 0', b"", body)
        assert b"policy_version" not in body
    return capture.encode_record(
        fx.header(api=api, stream=stream, call_id=call_id, policy_version=stamp), fx.request_body(api, stream), body
    )


def test_engine_policy_version_wins_over_the_stamp_and_mismatches_are_audited(tmp_path: Path) -> None:
    frames = [
        _with_version(api, stream, engine, stamp, f"{api}-{int(stream)}-{engine}-{stamp}")
        for api in fx.APIS
        for stream in (False, True)
        for engine, stamp in ((2, 0), (3, 3), (None, 5))
    ]
    fx.write_segment(tmp_path / "cap" / "p-1.seg", frames)
    rep = land(tmp_path / "cap", tmp_path / "lake")
    assert rep.policy_version_mismatches == 8
    got = run_sql(
        tmp_path / "lake", "select call_id, policy_version, proxy_policy_version from model_calls"
    ).to_pylist()
    for r in got:
        _, _, engine, stamp = r["call_id"].split("-")
        assert r["policy_version"] == (int(stamp) if engine == "None" else int(engine)), r
        assert r["proxy_policy_version"] == int(stamp)
    listed = run_audits(tmp_path / "lake")["policy_version_mismatch"].column("call_id").to_pylist()
    assert sorted(listed) == sorted(r["call_id"] for r in got if r["call_id"].endswith("-2-0"))


def test_audit_lists_ok_calls_claiming_upstream_ids_without_them(tmp_path: Path) -> None:
    no_prompt = json.loads(fx.response_body("chat", False))
    del no_prompt["prompt_token_ids"]
    no_completion = json.loads(fx.response_body("chat", False))
    del no_completion["choices"][0]["token_ids"]
    frames = [
        capture.encode_record(fx.header(call_id="no-prompt"), b"{}", json.dumps(no_prompt).encode()),
        capture.encode_record(fx.header(call_id="no-completion"), b"{}", json.dumps(no_completion).encode()),
        capture.encode_record(fx.header(call_id="honest", token_source="none"), b"{}", json.dumps(no_prompt).encode()),
        fx.record(call_id="fine"),
    ]
    fx.write_segment(tmp_path / "cap" / "i-1.seg", frames)
    land(tmp_path / "cap", tmp_path / "lake")
    rows = run_audits(tmp_path / "lake")["upstream_ids_missing"].to_pylist()
    assert [(r["call_id"], r["no_prompt_ids"], r["no_completion_ids"]) for r in rows] == [
        ("no-completion", False, True),
        ("no-prompt", True, False),
    ]


def test_audit_lists_ok_calls_with_an_error_text(tmp_path: Path) -> None:
    rows: list[dict[str, Any]] = [
        {"call_id": c, "choice_index": 0, "run_id": "A", "iteration": 0, "rollout_id": "r", "status": s, "error": e}
        for c, s, e in (("bad", "ok", "boom"), ("fine", "ok", None), ("failed", "http_error", "500"))
    ]
    tables.replace_partition(tmp_path, "model_calls", "A", 0, pa.Table.from_pylist(rows, schema=schemas.MODEL_CALLS))
    assert run_audits(tmp_path)["ok_calls_with_error"].column("call_id").to_pylist() == ["bad"]


def test_files_without_the_stamp_column_still_read_audit_and_compact(tmp_path: Path) -> None:
    """A partition landed before proxy_policy_version existed: views, audits and compaction see it as null."""
    cap, lake = tmp_path / "cap", tmp_path / "lake"
    fx.write_segment(cap / "a-1.seg", [fx.record(call_id="new")])
    land(cap, lake)
    old = pa.Table.from_pylist(
        [
            {
                "call_id": "old",
                "choice_index": 0,
                "run_id": "run1",
                "iteration": 0,
                "rollout_id": "r0",
                "policy_version": 1,
            }
        ],
        schema=schemas.MODEL_CALLS,
    ).drop_columns(["proxy_policy_version"])
    part_dir = lake / "model_calls" / "run_id=run1" / "iteration=0"
    pq.write_table(old, part_dir / "part-old.parquet")
    only_old = tmp_path / "only-old"
    (only_old / "model_calls" / "run_id=run1" / "iteration=0").mkdir(parents=True)
    pq.write_table(old, only_old / "model_calls" / "run_id=run1" / "iteration=0" / "part-old.parquet")
    assert run_audits(only_old)["policy_version_mismatch"].num_rows == 0
    assert run_sql(only_old, "select proxy_policy_version from model_calls").column(0).to_pylist() == [None]
    assert compact(lake).rows == 2
    got = run_sql(lake, "select call_id, proxy_policy_version from model_calls order by 1").to_pylist()
    assert got == [{"call_id": "new", "proxy_policy_version": 3}, {"call_id": "old", "proxy_policy_version": None}]
