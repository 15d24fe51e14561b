"""Every API's response shape, streamed and not, lands as the same model_calls columns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from clawpipe import capture
from clawpipe.lake import land, run_sql
from clawpipe.lake.parse import ParseError, parse_response
from tests.lake import fixtures as fx

COMPARED = (
    "prompt_token_ids",
    "completion_token_ids",
    "completion_logprobs",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "policy_version",
    "token_source",
    "status",
    "error",
)


def _land_all(tmp_path: Path, c: fx.Completion) -> list[dict[str, Any]]:
    frames = []
    for i, api in enumerate(fx.APIS):
        for stream in (False, True):
            frames.append(fx.record(api, stream, c, seq=2 * i + stream, call_id=f"{api}-{int(stream)}"))
    fx.write_segment(tmp_path / "cap" / "p-000001.seg", frames)
    land(tmp_path / "cap", tmp_path / "lake")
    return run_sql(tmp_path / "lake", "select * from model_calls order by seq").to_pylist()


def _normalised(row: dict[str, Any]) -> tuple[Any, ...]:
    tools = json.loads(row["tool_calls"]) if row["tool_calls"] else None
    if tools:
        tools = [(t["id"], t["type"], t["function"]["name"], json.loads(t["function"]["arguments"])) for t in tools]
    return (*(row[k] for k in COMPARED), tools)


@pytest.mark.parametrize(
    ("tool", "finish"),
    [(None, "stop"), (("lookup", {"city": "Oslo", "days": 3}), "tool_calls"), (None, "length")],
    ids=["stop", "tool-call", "length"],
)
def test_every_api_shape_gives_the_same_columns(tmp_path: Path, tool: Any, finish: str) -> None:
    c = fx.Completion(tool=tool, finish=finish)
    rows = _land_all(tmp_path, c)
    assert len(rows) == 8
    want_tools = [("call_1", "function", tool[0], tool[1])] if tool else None
    for row in rows:
        got = _normalised(row)
        expect_tools = None if row["api"] == "completions" else want_tools  # completions have no tools
        assert got[:-1] == (
            c.prompt_ids,
            c.ids,
            pytest.approx(c.logprobs),
            finish,
            len(c.prompt_ids),
            len(c.ids),
            c.policy_version,
            "upstream",
            "ok",
            None,
        ), (row["api"], row["stream"])
        assert got[-1] == expect_tools, (row["api"], row["stream"])
        assert row["choice_index"] == 0
        json.loads(row["response"])  # streams are stored reassembled, as JSON
        assert row["latency_ms"] == pytest.approx(50.0, abs=0.01)


def test_streams_are_reassembled_into_the_non_streamed_shape(tmp_path: Path) -> None:
    c = fx.Completion(tool=("f", {"a": 1}), finish="tool_calls")
    rows = {(r["api"], r["stream"]): json.loads(r["response"]) for r in _land_all(tmp_path, c)}
    chat = rows[("chat", True)]
    assert chat["choices"][0]["message"]["content"] == "Hello!"
    assert chat["choices"][0]["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert chat["usage"]["completion_tokens"] == 3
    msg = rows[("messages", True)]
    assert [b["type"] for b in msg["content"]] == ["text", "tool_use"]
    assert msg["content"][1]["input"] == {"a": 1} and msg["content"][0]["text"] == "Hello!"
    assert rows[("responses", True)]["status"] == "completed"
    assert rows[("completions", True)]["choices"][0]["text"] == "Hello!"


def test_several_choices_make_one_row_each(tmp_path: Path) -> None:
    body = {
        "id": "x",
        "object": "chat.completion",
        "model": "tiny",
        "prompt_token_ids": [1, 2],
        "choices": [
            {
                "index": i,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": str(i)},
                "token_ids": [10 + i, 20 + i],
                "logprobs": {"content": [{"logprob": -1.0}, {"logprob": -2.0}]},
            }
            for i in range(3)
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 6},
    }
    frame = capture.encode_record(fx.header(call_id="multi"), b"{}", json.dumps(body).encode())
    fx.write_segment(tmp_path / "cap" / "p-1.seg", [frame])
    land(tmp_path / "cap", tmp_path / "lake")
    rows = run_sql(
        tmp_path / "lake",
        "select choice_index, completion_token_ids, completion_tokens, prompt_tokens from model_calls order by 1",
    ).to_pylist()
    assert rows == [
        {"choice_index": i, "completion_token_ids": [10 + i, 20 + i], "completion_tokens": 2, "prompt_tokens": 2}
        for i in range(3)
    ]


def test_chat_stream_with_two_choices_interleaved() -> None:
    chunks = [
        {"prompt_token_ids": [5], "choices": [{"index": 0, "delta": {"role": "assistant"}}, {"index": 1, "delta": {}}]},
        {
            "choices": [
                {"index": 1, "delta": {"content": "b"}, "token_ids": [21], "logprobs": {"content": [{"logprob": -0.2}]}}
            ]
        },
        {
            "choices": [
                {"index": 0, "delta": {"content": "a"}, "token_ids": [11], "logprobs": {"content": [{"logprob": -0.1}]}}
            ]
        },
        {
            "choices": [
                {"index": 0, "delta": {}, "finish_reason": "stop"},
                {"index": 1, "delta": {}, "finish_reason": "length"},
            ]
        },
    ]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"
    p = parse_response("chat", True, body)
    assert [(c.index, c.token_ids, c.logprobs, c.finish_reason) for c in p.choices] == [
        (0, [11], [-0.1], "stop"),
        (1, [21], [-0.2], "length"),
    ]
    assert p.prompt_token_ids == [5]


def test_retokenized_calls_take_ids_from_the_header_and_no_logprobs(tmp_path: Path) -> None:
    retok = {"prompt_token_ids": [1, 2, 3], "choices": [{"token_ids": [4, 5]}]}
    body = json.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}],
        }
    ).encode()
    frame = capture.encode_record(fx.header(token_source="retokenized", retokenized=retok), b"{}", body)
    fx.write_segment(tmp_path / "cap" / "p-1.seg", [frame])
    land(tmp_path / "cap", tmp_path / "lake")
    row = run_sql(tmp_path / "lake", "select * from model_calls").to_pylist()[0]
    assert (row["prompt_token_ids"], row["completion_token_ids"], row["completion_logprobs"]) == (
        [1, 2, 3],
        [4, 5],
        None,
    )
    assert row["token_source"] == "retokenized" and row["finish_reason"] == "stop"


def test_error_responses_land_with_their_error(tmp_path: Path) -> None:
    frames = [
        capture.encode_record(
            fx.header(call_id="e-json", status="http_error", http_status=400),
            b"{}",
            b'{"error": {"message": "max_tokens too large", "type": "invalid_request_error"}}',
        ),
        capture.encode_record(
            fx.header(call_id="e-html", status="upstream_error", http_status=502, error="upstream unreachable"),
            b"{}",
            b"<html>bad gateway</html>",
        ),
        capture.encode_record(
            fx.header(api="messages", call_id="e-anthropic", status="http_error", http_status=529),
            b"{}",
            b'{"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}',
        ),
        capture.encode_record(
            fx.header(call_id="e-vllm", status="http_error", http_status=400),
            b"{}",
            b'{"object": "error", "message": "context too long", "type": "BadRequestError", "code": 400}',
        ),
        capture.encode_record(
            fx.header(call_id="e-detail", status="http_error", http_status=503),
            b"{}",
            b'{"detail": "engine is loading"}',
        ),
        capture.encode_record(
            fx.header(api="messages", stream=True, call_id="e-stream", status="ok"),
            b"{}",
            b'event: error\ndata: {"type": "error", "error": {"type": "api_error", "message": "boom"}}\n\n',
        ),
    ]
    fx.write_segment(tmp_path / "cap" / "p-1.seg", frames)
    rep = land(tmp_path / "cap", tmp_path / "lake")
    assert rep.rejects == 0
    rows = run_sql(
        tmp_path / "lake",
        "select call_id, error, completion_token_ids, token_source, response from model_calls order by 1",
    ).to_pylist()
    got = {r["call_id"]: (r["error"], r["completion_token_ids"]) for r in rows}
    assert got == {
        "e-anthropic": ("Overloaded", None),
        "e-detail": ("engine is loading", None),
        "e-vllm": ("context too long", None),
        "e-html": ("upstream unreachable", None),
        "e-json": ("max_tokens too large", None),
        "e-stream": ("boom", None),
    }


def test_cut_stream_keeps_what_arrived() -> None:
    body = fx.response_body("chat", True)
    cut = body[: body.rfind(b"data: {", 0, body.find(b'"finish_reason": "stop"'))] + b'data: {"choi'
    p = parse_response("chat", True, cut)
    assert p.choices[0].token_ids == [7, 8, 9] and p.choices[0].finish_reason is None
    with pytest.raises(ParseError):
        parse_response("chat", True, b"data: {bad json}\n\ndata: {}\n\n")
    with pytest.raises(ParseError):
        parse_response("chat", False, b"not json at all", http_status=200)


def test_large_prompt_fast_path_matches_the_plain_parse() -> None:
    ids = list(range(40_000))
    body = json.dumps(
        {
            "object": "chat.completion",
            "prompt_token_ids": ids,
            "choices": [
                {
                    "index": 0,
                    "token_ids": [1],
                    "finish_reason": "stop",
                    "message": {"content": "x"},
                    "logprobs": {"content": [{"logprob": -1.0}]},
                }
            ],
        }
    ).encode()
    assert list(parse_response("chat", False, body).prompt_token_ids) == ids
    # the key nested inside a tool input (an object the model wrote) must not be taken for the real one
    nested = json.dumps(
        {
            "type": "message",
            "content": [
                {"type": "tool_use", "id": "t", "name": "n", "input": {"prompt_token_ids": [9, 9], "pad": "x" * 40_000}}
            ],
            "stop_reason": "tool_use",
        }
    ).encode()
    p = parse_response("messages", False, nested)
    assert p.prompt_token_ids is None
    assert json.loads(p.choices[0].tool_calls[0]["function"]["arguments"])["prompt_token_ids"] == [9, 9]


@pytest.mark.parametrize(
    ("ids", "lands"),
    [
        ("1, 2,\t3", [1, 2, 3]),  # spaces around commas: JSON
        ("1 ,\n2", [1, 2]),
        ("1, ,2", None),  # an empty place: not JSON, never a 0
        ("1,,2", None),
        ("1,2,", None),
        (",1,2", None),
        ("1,2 3", None),  # two numbers without a comma: never 23
    ],
)
def test_large_prompt_fast_path_takes_json_lists_only(ids: str, lands: list[int] | None) -> None:
    body = (
        '{"object":"chat.completion","pad":"' + "x" * 40_000 + '","prompt_token_ids":[' + ids + "],"
        '"choices":[{"index":0,"token_ids":[1],"finish_reason":"stop","message":{"content":"x"}}]}'
    ).encode()
    if lands is None:
        with pytest.raises(ParseError):
            parse_response("chat", False, body)
    else:
        assert list(parse_response("chat", False, body).prompt_token_ids) == lands


def _as_lists(p: Any) -> Any:
    """A parsed call with its id and logprob arrays (the compiled reader's array.array) as lists."""
    import array
    import dataclasses

    def plain(v: Any) -> Any:
        return v.tolist() if isinstance(v, array.array) else v

    choices = [
        dataclasses.replace(
            c, token_ids=plain(c.token_ids), prompt_token_ids=plain(c.prompt_token_ids), logprobs=plain(c.logprobs)
        )
        for c in p.choices
    ]
    return dataclasses.replace(p, prompt_token_ids=plain(p.prompt_token_ids), choices=choices)


def test_typed_fast_path_agrees_with_the_generic_parser() -> None:
    import orjson

    from clawpipe.lake.openai_fast import parse_openai_fast
    from clawpipe.lake.parse import ParsedCall, parse_openai

    completions_legacy = {
        "object": "text_completion",
        "prompt_token_ids": [1],
        "choices": [
            {
                "index": 0,
                "text": "ab",
                "finish_reason": "length",
                "token_ids": [5, 6],
                "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.5, -1.5]},
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2},
    }
    bodies = [
        ("chat", fx.response_body("chat", False, fx.Completion(tool=("f", {"x": [1, 2]}), finish="tool_calls"))),
        ("completions", fx.response_body("completions", False)),
        ("completions", json.dumps(completions_legacy).encode()),
        ("chat", json.dumps({"object": "chat.completion", "choices": []}).encode()),
    ]
    for api, body in bodies:
        fast = parse_openai_fast(body, api)
        assert fast is not None, body
        slow = ParsedCall(response=body)
        parse_openai(orjson.loads(body), api, slow)
        assert _as_lists(fast) == slow, api
    # shapes outside the fast path are left to the generic parser
    assert parse_openai_fast(b'{"object": "error", "message": "x"}', "chat") is None
    assert parse_openai_fast(b'{"choices": [{"message": {"tool_calls": "oops"}}]}', "chat") is None
    assert parse_openai_fast(b'{"error": {"message": "x"}}', "chat") is None
