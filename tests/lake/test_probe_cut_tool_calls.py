"""Answers cut by max_tokens in the middle of a tool call's arguments, streamed through each API, landed from a
real capture segment: every API gives the same columns (``finish_reason`` length, the arguments received so
far as the ``arguments`` string), and an Anthropic turn's redacted_thinking and thinking blocks are kept in
the response as streamed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.apis import captures as cx

PROMPT = [1, 2, 3]
IDS = [40, 41, 42, 43]
CUT = '{"path": "src/ma'  # the arguments when max_tokens cut the answer
TOOLS_CHAT = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]


def _chat_stream() -> bytes:
    def chunk(delta: dict[str, Any], ids: list[int], **kw: Any) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": None, "token_ids": ids, **kw}
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "choices": [choice]}

    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "read", "arguments": ""}}
    return cx.sse(
        [
            {**chunk({"role": "assistant", "tool_calls": [call]}, IDS[:1]), "prompt_token_ids": PROMPT},
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": CUT[:9]}}]}, IDS[1:3]),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": CUT[9:]}}]}, IDS[3:], finish_reason="length"),
            "[DONE]",
        ],
        named=False,
    )


def _messages_stream() -> bytes:
    start = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-x",
        "content": [],
        "stop_reason": None,
        "usage": {"input_tokens": 3, "output_tokens": 0},
        "prompt_token_ids": PROMPT,
    }
    tool = {"type": "tool_use", "id": "call_1", "name": "read", "input": {}}
    return cx.sse(
        [
            {"type": "message_start", "message": start},
            {"type": "content_block_start", "index": 0, "content_block": {"type": "redacted_thinking", "data": "EnC="}},
            {"type": "content_block_stop", "index": 0},
            {"type": "content_block_start", "index": 1, "content_block": {"type": "thinking", "thinking": ""}},
            {"type": "content_block_delta", "index": 1, "delta": {"type": "thinking_delta", "thinking": "Read it."}},
            {"type": "content_block_delta", "index": 1, "delta": {"type": "signature_delta", "signature": "sig"}},
            {"type": "content_block_stop", "index": 1},
            {"type": "content_block_start", "index": 2, "content_block": tool},
            {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": CUT[:9]}},
            {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": CUT[9:]}},
            {
                "type": "message_delta",
                "delta": {"stop_reason": "max_tokens"},
                "usage": {"output_tokens": len(IDS)},
                "token_ids": IDS,
                "logprobs": {"content": [{"token": "t", "logprob": -0.5} for _ in IDS]},
            },
            {"type": "message_stop"},
        ]
    )


def _land(tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    frames = [
        cx.record(
            "chat", {"model": "m", "messages": [], "tools": TOOLS_CHAT}, _chat_stream(), stream=True, seq=0, call_id="c"
        ),
        cx.record(
            "messages", {"model": "claude-x", "messages": []}, _messages_stream(), stream=True, seq=1, call_id="m"
        ),
    ]
    lake = cx.land_frames(tmp_path, frames, [{"rollout_id": "r0", "reward": 1.0}])
    assert cx.rejects(lake) == []
    chat, messages = cx.calls(lake)
    return chat, messages


def test_a_tool_call_cut_by_max_tokens_lands_alike_through_chat_and_messages(tmp_path: Path) -> None:
    chat, messages = _land(tmp_path)
    cut_call = [{"id": "call_1", "type": "function", "function": {"name": "read", "arguments": CUT}}]
    for row in (chat, messages):
        assert (row["status"], row["finish_reason"]) == ("ok", "length"), row["api"]
        assert json.loads(row["tool_calls"]) == cut_call, row["api"]
        assert (row["prompt_token_ids"], row["completion_token_ids"]) == (PROMPT, IDS), row["api"]


def test_thinking_blocks_of_the_cut_turn_stay_in_the_response(tmp_path: Path) -> None:
    _, messages = _land(tmp_path)
    content = json.loads(messages["response"])["content"]
    assert content[0] == {"type": "redacted_thinking", "data": "EnC="}
    assert content[1] == {"type": "thinking", "thinking": "Read it.", "signature": "sig"}
    assert content[2]["type"] == "tool_use" and content[2]["input"] == {"_unparsed": CUT}


def test_a_tool_input_that_happens_to_be_named_like_the_cut_marker_is_kept_as_sent(tmp_path: Path) -> None:
    body = {
        "id": "msg_2",
        "type": "message",
        "role": "assistant",
        "model": "claude-x",
        "content": [{"type": "tool_use", "id": "call_2", "name": "read", "input": {"_unparsed": "x"}}],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 3, "output_tokens": 2},
    }
    frame = cx.record(
        "messages", {"model": "claude-x", "messages": []}, json.dumps(body).encode(), stream=False, seq=0, call_id="p"
    )
    (row,) = cx.calls(cx.land_frames(tmp_path, [frame]))
    assert json.loads(json.loads(row["tool_calls"])[0]["function"]["arguments"]) == {"_unparsed": "x"}
