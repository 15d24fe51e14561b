"""The capture header is one typed struct from the proxy to the lake: what the proxy records reaches model_calls
field by field, headers written before it was typed (format 2) still land, and a typed header with a missing,
unknown or mistyped field is one reject naming the segment, the record and the field."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import msgspec
import openai
import pytest

from clawpipe import capture, schemas
from clawpipe.errors import CaptureHeaderError
from clawpipe.lake import land, run_sql
from tests.proxy.conftest import ProxyHandle
from tests.support.upstream import ScriptedUpstream, say


def _typed(rec: capture.CaptureRecord) -> capture.CaptureHeader:
    return capture.decode_header(json.dumps(rec.header).encode())


def test_a_proxied_calls_header_fields_reach_model_calls(
    proxy: ProxyHandle, upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    upstream.push(say("one"), say("two"))
    client = openai.OpenAI(base_url=proxy.openai_base("r7", iteration=3), api_key="unused", max_retries=0)
    for text in ("a", "b"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}])
    proxy.server.stop()
    headers = [_typed(r) for r in proxy.records()]
    assert [h.format for h in headers] == [capture.HEADER_FORMAT] * 2  # the proxy writes typed headers

    lake = tmp_path / "lake"
    rep = land(proxy.capture_dir, lake)
    assert (rep.calls, rep.rejects) == (2, 0)
    got = run_sql(
        lake,
        "select call_id, run_id, iteration, rollout_id, seq, api, path, stream, status, http_status, error, model,"
        " proxy_policy_version, token_source, request_changes, upstream_ms,"
        " epoch_us(t_start) as t_start, epoch_us(t_end) as t_end from model_calls order by seq",
    ).to_pylist()
    want = [
        {
            "call_id": h.call_id,
            "run_id": h.run_id,
            "iteration": h.iteration,
            "rollout_id": h.rollout_id,
            "seq": h.seq,
            "api": h.api,
            "path": h.path,
            "stream": h.stream,
            "status": h.status,
            "http_status": h.http_status,
            "error": h.error,
            "model": h.model,
            "proxy_policy_version": h.policy_version,
            "token_source": h.token_source,
            "request_changes": json.dumps(json.loads(bytes(h.request_changes)), separators=(",", ":")),
            "upstream_ms": h.upstream_ms,
            "t_start": int(h.t_start * 1_000_000) if h.t_start is not None else None,
            "t_end": int(h.t_end * 1_000_000) if h.t_end is not None else None,
        }
        for h in headers
    ]
    assert got == want
    assert [(g["run_id"], g["iteration"], g["rollout_id"], g["seq"]) for g in got] == [
        ("run1", 3, "r7", 0),
        ("run1", 3, "r7", 1),
    ]
    assert json.loads(got[0]["request_changes"]) == {"added": {"return_token_ids": True, "logprobs": True}}


# A header as format-2 proxies wrote it: a JSON object without "format", json.dumps'd.
FORMAT2_HEADER = {
    "call_id": "old-1",
    "run_id": "run1",
    "iteration": 0,
    "rollout_id": "r0",
    "seq": 4,
    "api": "chat",
    "method": "POST",
    "path": "/v1/chat/completions",
    "query": "",
    "stream": False,
    "http_status": 200,
    "status": "ok",
    "error": None,
    "model": "tiny",
    "policy_version": 2,
    "t_start": 1_700_000_000.25,
    "t_end": 1_700_000_000.5,
    "upstream_ms": 240.0,
    "request_changes": {"added": {"return_token_ids": True}},
    "token_source": "upstream",
    "upstream": "http://127.0.0.1:1",
}

CHAT_RESPONSE = {
    "id": "x",
    "object": "chat.completion",
    "model": "tiny",
    "prompt_token_ids": [1, 2, 3],
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi"},
            "finish_reason": "stop",
            "token_ids": [4, 5],
            "logprobs": {"content": [{"token": "h", "logprob": -0.5}, {"token": "i", "logprob": -0.25}]},
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2},
}


def _frame(header: capture.CaptureHeader | dict[str, typing.Any]) -> bytes:
    request = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode()
    return capture.encode_record(header, request, json.dumps(CHAT_RESPONSE).encode())


def test_a_format_2_record_decodes_and_lands(tmp_path: Path) -> None:
    frame = _frame(FORMAT2_HEADER)
    (rec,) = capture.read_segment(_write(tmp_path / "cap" / "old-1.seg", [frame]))
    assert isinstance(rec, capture.CaptureRecord) and "format" not in rec.header
    h = capture.decode_header(json.dumps(rec.header).encode())
    assert (h.format, h.call_id, h.iteration, h.seq, h.status, h.policy_version) == (2, "old-1", 0, 4, "ok", 2)
    assert msgspec.json.decode(bytes(h.request_changes)) == {"added": {"return_token_ids": True}}
    assert h.retokenized is None and h.response_partial is None  # fields the old proxy left out: defaults

    lake = tmp_path / "lake"
    assert (land(tmp_path / "cap", lake).calls, land(tmp_path / "cap", lake).calls) == (1, 0)
    row = run_sql(lake, "select call_id, seq, proxy_policy_version, prompt_token_ids from model_calls").to_pylist()
    assert row == [{"call_id": "old-1", "seq": 4, "proxy_policy_version": 2, "prompt_token_ids": [1, 2, 3]}]


def _typed_header(call_id: str, **kw: typing.Any) -> capture.CaptureHeader:
    return capture.CaptureHeader(
        format=capture.HEADER_FORMAT, call_id=call_id, run_id="run1", iteration=0, rollout_id="r0", **kw
    )


def _write(path: Path, frames: list[bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(frames))
    return path


def _with(header: capture.CaptureHeader, change: dict[str, typing.Any], drop: str | None = None) -> dict:
    d = msgspec.json.decode(msgspec.json.encode(header))
    d.update(change)
    if drop is not None:
        del d[drop]
    return d


@pytest.mark.parametrize(
    ("case", "named", "said"),
    [
        ({"surprise": 1}, "surprise", "unknown"),
        ({"iteration": "5"}, "iteration", "Expected `int`, got `str`"),
        ({"status": "fine"}, "status", "Invalid enum value 'fine'"),
        ({"t_end": -3.0}, "t_end", ">= 0.0"),
        ({"drop": "rollout_id"}, "rollout_id", "missing"),
        ({"run_id": "r" * 300}, "run_id", "length <= 200"),  # longer than a partition directory's name may be
        ({"format": capture.HEADER_FORMAT + 1}, "format", "land it with the version that wrote it"),
    ],
)
def test_a_typed_headers_bad_field_is_one_reject_naming_segment_record_and_field(
    tmp_path: Path, case: dict[str, typing.Any], named: str, said: str
) -> None:
    drop = case.pop("drop", None)
    bad = _with(_typed_header("bad", t_start=1_700_000_000.0), case, drop)
    frames = [_frame(_typed_header("before")), _frame(bad), _frame(_typed_header("after"))]
    _write(tmp_path / "cap" / "t-1.seg", frames)
    rep = land(tmp_path / "cap", tmp_path / "lake")
    assert (rep.calls, rep.rejects) == (2, 1)
    (reason,) = run_sql(tmp_path / "lake", "select reason from rejects").column(0).to_pylist()
    assert f"segment t-1, record at offset {len(frames[0])}" in reason
    assert f"capture header field {named}" in reason and said in reason


def test_decode_header_names_the_field_and_where() -> None:
    with pytest.raises(CaptureHeaderError, match=r"^seg-9 @ 12: capture header field run_id is missing"):
        capture.decode_header(b'{"format":3,"call_id":"c","iteration":0,"rollout_id":"r"}', "seg-9 @ 12")


def test_the_headers_vocabularies_are_the_schemas() -> None:
    assert set(typing.get_args(capture.CallStatusName)) == {s.value for s in schemas.CallStatus}
    assert set(typing.get_args(capture.TokenSourceName)) == {s.value for s in schemas.TokenSource}


def test_a_format_2_header_with_a_run_id_too_long_for_a_partition_is_one_reject(tmp_path: Path) -> None:
    frames = [_frame(FORMAT2_HEADER), _frame(dict(FORMAT2_HEADER, call_id="long", run_id="r" * 300))]
    _write(tmp_path / "cap" / "old-2.seg", frames)
    rep = land(tmp_path / "cap", tmp_path / "lake")
    assert (rep.calls, rep.rejects) == (1, 1)
    (reason,) = run_sql(tmp_path / "lake", "select reason from rejects").column(0).to_pylist()
    assert "header run_id is 300 characters long, longer than 200" in reason
