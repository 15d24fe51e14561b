"""Streams of each API, framed by the one SSE writer and read by the one reader, reassemble into the body
the same call returns unstreamed; request bodies of three APIs give the same template messages."""

from __future__ import annotations

import json
from typing import Any

import pytest

from clawpipe.apis import read_events, reassemble, request_messages, sse_frame, text_of
from clawpipe.errors import RequestShapeError


def _events(frames: bytes) -> list[dict[str, Any]]:
    return [json.loads(ev.data) for ev in read_events(frames) if ev.data != b"[DONE]"]


def test_chat_stream_joins_text_tool_call_pieces_ids_and_logprobs() -> None:
    chunks = [
        {
            "id": "c1",
            "model": "m",
            "prompt_token_ids": [1, 2],
            "choices": [{"index": 0, "delta": {"role": "assistant"}}],
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "hi "},
                    "token_ids": [5],
                    "logprobs": {"content": [{"logprob": -0.5}]},
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "id": "t1", "function": {"name": "f", "arguments": '{"a"'}}]},
                    "token_ids": [6],
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                    "finish_reason": "tool_calls",
                }
            ]
        },
        {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}},
    ]
    wire = b"".join(sse_frame(c) for c in chunks) + b"data: [DONE]\n\n"
    body = reassemble("chat", _events(wire))
    (choice,) = body["choices"]
    assert body["prompt_token_ids"] == [1, 2] and body["usage"]["completion_tokens"] == 2
    assert choice["message"]["content"] == "hi " and choice["token_ids"] == [5, 6]
    assert choice["message"]["tool_calls"] == [
        {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]
    assert choice["logprobs"] == {"content": [{"logprob": -0.5}]} and choice["finish_reason"] == "tool_calls"


def test_messages_stream_gives_text_and_tool_use_blocks() -> None:
    events = [
        {"type": "message_start", "message": {"id": "m1", "model": "m", "usage": {"input_tokens": 3}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "ok"}},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "t", "name": "sh"}},
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '{"cmd": "ls"}'},
        },
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 4}},
        {"type": "message_stop"},
    ]
    wire = b"".join(sse_frame(e, e["type"]) for e in events)
    body = reassemble("messages", _events(wire))
    assert body["content"] == [
        {"type": "text", "text": "ok"},
        {"type": "tool_use", "id": "t", "name": "sh", "input": {"cmd": "ls"}},
    ]
    assert body["stop_reason"] == "tool_use" and body["usage"] == {"input_tokens": 3, "output_tokens": 4}


def test_responses_stream_cut_short_is_incomplete_with_the_items_that_arrived() -> None:
    item = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]}
    events = [
        {"type": "response.created", "response": {"id": "r", "policy_version": 3}},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
    ]
    body = reassemble("responses", events)
    assert body["status"] == "incomplete" and body["output"] == [item] and body["policy_version"] == 3
    done = reassemble(
        "responses", [*events, {"type": "response.completed", "response": {"id": "r", "status": "completed"}}]
    )
    assert done == {"id": "r", "status": "completed", "policy_version": 3}


def test_one_conversation_in_three_dialects_gives_the_same_template_messages() -> None:
    chat = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "list"}]},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "sh", "arguments": '{"cmd": "ls"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": "a.txt"},
        ],
        "tools": [{"type": "function", "function": {"name": "sh", "parameters": {"type": "object"}}}],
    }
    messages = {
        "system": "be brief",
        "messages": [
            {"role": "user", "content": "list"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "c", "name": "sh", "input": {"cmd": "ls"}}]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "c", "content": [{"type": "text", "text": "a.txt"}]}
                ],
            },
        ],
        "tools": [{"name": "sh", "input_schema": {"type": "object"}}],
    }
    responses = {
        "instructions": "be brief",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list"}]},
            {"type": "function_call", "call_id": "c", "name": "sh", "arguments": '{"cmd": "ls"}'},
            {"type": "function_call_output", "call_id": "c", "output": "a.txt"},
        ],
        "tools": [{"type": "function", "name": "sh", "parameters": {"type": "object"}}],
    }
    got = [
        request_messages(api, body) for api, body in (("chat", chat), ("messages", messages), ("responses", responses))
    ]
    assert got[0] == got[1] == got[2]
    assert [m["role"] for m in got[0][0]] == ["system", "user", "assistant", "tool"]


def test_malformed_request_names_the_field() -> None:
    with pytest.raises(RequestShapeError, match=r"messages\[0\]\.role"):
        request_messages("chat", {"messages": [{"role": "robot", "content": "x"}]})
    for role in (["user"], {"a": 1}):  # unhashable: a TypeError out of the role lookup before
        with pytest.raises(RequestShapeError, match=r"messages\[0\]\.role must be one of .*, got a "):
            request_messages("chat", {"messages": [{"role": role, "content": "x"}]})
    with pytest.raises(RequestShapeError, match="content must be a string or a list"):
        text_of(42, "content")
