"""Anthropic Messages streams with blocks and events the engine never sends, landed from real capture segments:
thinking and redacted thinking with a signature, a server tool and its search result with citations, several
tool_use blocks whose input arrives split inside an escape, usage only at the end, pings, an error mid-stream."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from tests.apis import captures as cx

REQUEST = {
    "model": "claude-x",
    "max_tokens": 1024,
    "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
    "messages": [{"role": "user", "content": "Weather in Zürich, then list files and read a.txt."}],
    "tools": [
        {"name": "ls", "description": "list", "input_schema": {"type": "object"}},
        {"name": "cat", "description": "read", "input_schema": {"type": "object"}},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 1},
    ],
    "thinking": {"type": "enabled", "budget_tokens": 512},
}
LS_ARGS = {"dir": '/tmp/caf\u00e9 "q"', "emoji": "\U0001f600"}
CAT_ARGS = {"path": "a.txt"}
CITATION = {"type": "web_search_result_location", "url": "https://w.example", "title": "W", "cited_text": "sun"}


def _block(i: int, block: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_start", "index": i, "content_block": block}


def _delta(i: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": i, "delta": delta}


def _stop(i: int) -> dict[str, Any]:
    return {"type": "content_block_stop", "index": i}


def _json_pieces(i: int, value: dict[str, Any], cuts: list[int]) -> list[dict[str, Any]]:
    text = json.dumps(value)  # ASCII escapes: \u00e9, \", \ud83d\ude00
    bounds = [0, *cuts, len(text)]
    return [_delta(i, {"type": "input_json_delta", "partial_json": text[a:b]}) for a, b in itertools.pairwise(bounds)]


def agent_turn() -> list[dict[str, Any]]:
    """One streamed turn: thinking, redacted thinking, web search with a result, cited text, two tool calls."""
    ls_text = json.dumps(LS_ARGS)
    cut_escape = ls_text.index("\\u00e9") + 3  # inside \u00e9
    cut_quote = ls_text.index('\\"') + 1  # between the backslash and the quote it escapes
    cut_pair = ls_text.index("\\ude00") + 2  # between the two halves of a surrogate pair's escapes
    start = {
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "model": "claude-x",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 40, "cache_read_input_tokens": 100, "output_tokens": 1},
    }
    result = [{"type": "web_search_result", "url": "https://w.example", "title": "W", "encrypted_content": "EnC"}]
    return [
        {"type": "message_start", "message": start},
        {"type": "ping"},
        _block(0, {"type": "thinking", "thinking": "", "signature": ""}),
        _delta(0, {"type": "thinking_delta", "thinking": "Search, "}),
        _delta(0, {"type": "thinking_delta", "thinking": "then tools."}),
        _delta(0, {"type": "signature_delta", "signature": "SiG0=="}),
        _stop(0),
        _block(1, {"type": "redacted_thinking", "data": "ReDaCtEd"}),
        _stop(1),
        _block(2, {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}),
        _delta(2, {"type": "input_json_delta", "partial_json": '{"query": "weather Z'}),
        _delta(2, {"type": "input_json_delta", "partial_json": '\\u00fcrich"}'}),
        _stop(2),
        _block(3, {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": result}),
        _stop(3),
        _block(4, {"type": "text", "text": "", "citations": None}),
        _delta(4, {"type": "citations_delta", "citation": CITATION}),
        _delta(4, {"type": "text_delta", "text": "It is sunny. "}),
        {"type": "ping"},
        _delta(4, {"type": "text_delta", "text": "Now the files."}),
        _stop(4),
        _block(5, {"type": "tool_use", "id": "toolu_ls", "name": "ls", "input": {}}),
        *_json_pieces(5, LS_ARGS, [cut_escape, cut_quote, cut_pair]),
        _stop(5),
        _block(6, {"type": "tool_use", "id": "toolu_cat", "name": "cat", "input": {}}),
        _delta(6, {"type": "input_json_delta", "partial_json": ""}),
        *_json_pieces(6, CAT_ARGS, [3]),
        _stop(6),
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": None},
            # the final counts; what this API version leaves null is known from message_start
            "usage": {
                "input_tokens": None,
                "cache_read_input_tokens": None,
                "output_tokens": 77,
                "server_tool_use": {"web_search_requests": 1},
            },
        },
        {"type": "message_stop"},
    ]


def test_a_streamed_turn_with_thinking_search_citations_and_two_tools_lands_whole(tmp_path: Path) -> None:
    frames = [cx.record("messages", REQUEST, cx.sse(agent_turn()), stream=True, seq=0, call_id="m-agent")]
    lake = cx.land_frames(tmp_path, frames)
    assert cx.rejects(lake) == []
    (row,) = cx.calls(lake)
    assert row["status"] == "ok" and row["error"] is None and row["finish_reason"] == "tool_calls"
    # usage: message_start's input (cache reads included) and message_delta's final output count
    assert row["prompt_tokens"] == 140 and row["completion_tokens"] == 77
    assert json.loads(row["response"])["usage"]["server_tool_use"] == {"web_search_requests": 1}
    tools = json.loads(row["tool_calls"])
    assert [(t["id"], t["function"]["name"], json.loads(t["function"]["arguments"])) for t in tools] == [
        ("toolu_ls", "ls", LS_ARGS),
        ("toolu_cat", "cat", CAT_ARGS),
    ]  # the server's own web_search is not a call for the harness to run
    content = json.loads(row["response"])["content"]
    assert [b["type"] for b in content] == [
        "thinking",
        "redacted_thinking",
        "server_tool_use",
        "web_search_tool_result",
        "text",
        "tool_use",
        "tool_use",
    ]
    assert content[0] == {"type": "thinking", "thinking": "Search, then tools.", "signature": "SiG0=="}
    assert content[1]["data"] == "ReDaCtEd"
    assert content[2]["input"] == {"query": "weather Z\u00fcrich"}
    assert content[3]["content"][0]["encrypted_content"] == "EnC"
    assert content[4]["text"] == "It is sunny. Now the files."
    assert content[4]["citations"] == [CITATION]
    assert content[5]["input"] == LS_ARGS


def test_the_captured_blocks_are_queryable_with_sql(tmp_path: Path) -> None:
    frames = [cx.record("messages", REQUEST, cx.sse(agent_turn()), stream=True, seq=0, call_id="m-agent")]
    lake = cx.land_frames(tmp_path, frames)
    got = cx.run_sql(
        lake,
        "select json_extract_string(response, '$.content[2].input.query') as q, "
        "json_extract_string(response, '$.content[4].citations[0].url') as url, "
        "json_extract_string(response, '$.content[0].signature') as sig from model_calls",
    ).to_pylist()
    assert got == [{"q": "weather Z\u00fcrich", "url": "https://w.example", "sig": "SiG0=="}]


def test_an_error_event_mid_stream_lands_as_an_upstream_error_keeping_what_arrived(tmp_path: Path) -> None:
    events = agent_turn()[:19]  # through the first text delta of block 4
    start = events[0]["message"]
    start["prompt_token_ids"] = [11, 12, 13]
    events.append({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
    frames = [cx.record("messages", REQUEST, cx.sse(events), stream=True, seq=0, call_id="m-cut")]
    lake = cx.land_frames(tmp_path, frames)
    assert cx.rejects(lake) == []
    (row,) = cx.calls(lake)
    assert row["status"] == "upstream_error" and row["error"] == "Overloaded"
    assert row["finish_reason"] == "error"
    # the prompt the engine saw and its size stay: a failed call's prompt is context in the trees
    assert row["prompt_token_ids"] == [11, 12, 13] and row["prompt_tokens"] == 140
    body = json.loads(row["response"])
    assert body["content"][4]["text"] == "It is sunny. " and body["error"]["type"] == "overloaded_error"


def _utf16_pieces(text: str) -> tuple[str, str]:
    """``text`` cut between the two halves of its first surrogate pair, as a server holding UTF-16 strings
    cuts it: each half is a lone surrogate, which its JSON encoder writes as a \\uXXXX escape."""
    units = text.encode("utf-16-le", "surrogatepass")
    cut = next(i for i in range(0, len(units), 2) if 0xD8 <= units[i + 1] <= 0xDB) + 2
    return (units[:cut].decode("utf-16-le", "surrogatepass"), units[cut:].decode("utf-16-le", "surrogatepass"))


def test_deltas_cut_inside_a_surrogate_pair_land_whole(tmp_path: Path) -> None:
    args = json.dumps({"emoji": "\U0001f600", "dir": "caf\u00e9"}, ensure_ascii=False)  # raw characters
    a1, a2 = _utf16_pieces(args)
    t1, t2 = _utf16_pieces("Done \U0001f389 now")
    start = {"id": "msg_2", "type": "message", "role": "assistant", "content": [], "usage": {"input_tokens": 5}}
    events = [
        {"type": "message_start", "message": start},
        _block(0, {"type": "text", "text": ""}),
        _delta(0, {"type": "text_delta", "text": t1}),
        _delta(0, {"type": "text_delta", "text": t2}),
        _stop(0),
        _block(1, {"type": "tool_use", "id": "toolu_e", "name": "ls", "input": {}}),
        _delta(1, {"type": "input_json_delta", "partial_json": a1}),
        _delta(1, {"type": "input_json_delta", "partial_json": a2}),
        _stop(1),
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}},
        {"type": "message_stop"},
    ]
    body = cx.sse(events)
    assert b'\\ud83d"' in body  # the events' JSON holds lone surrogate escapes
    lake = cx.land_frames(tmp_path, [cx.record("messages", REQUEST, body, stream=True, seq=0, call_id="m-utf16")])
    assert cx.rejects(lake) == []
    (row,) = cx.calls(lake)
    content = json.loads(row["response"])["content"]
    assert content[0]["text"] == "Done \U0001f389 now"
    assert content[1]["input"] == {"emoji": "\U0001f600", "dir": "caf\u00e9"}
    (tool,) = json.loads(row["tool_calls"])
    assert json.loads(tool["function"]["arguments"]) == {"emoji": "\U0001f600", "dir": "caf\u00e9"}


def test_stop_reasons_of_server_tools_and_a_full_context_land_in_the_lake_s_words(tmp_path: Path) -> None:
    search = {"type": "server_tool_use", "id": "srvtoolu_2", "name": "web_search", "input": {"query": "q"}}
    bodies = {
        "pause_turn": [search],  # the server paused its own long turn: the harness sends it back to go on
        "model_context_window_exceeded": [{"type": "text", "text": "cut"}],
    }
    frames = []
    for i, (stop, content) in enumerate(bodies.items()):
        body = {"id": f"msg_{i}", "type": "message", "role": "assistant", "content": content, "stop_reason": stop}
        body["usage"] = {"input_tokens": 4, "output_tokens": 2}
        frames.append(cx.record("messages", REQUEST, json.dumps(body).encode(), stream=False, seq=i, call_id=stop))
    lake = cx.land_frames(tmp_path, frames)
    paused, full = cx.calls(lake)
    assert (paused["finish_reason"], paused["tool_calls"], paused["status"]) == ("pause_turn", None, "ok")
    assert (full["finish_reason"], full["status"]) == ("length", "ok")


def test_a_message_with_a_null_error_field_is_not_an_error(tmp_path: Path) -> None:
    body = {"id": "m", "type": "message", "role": "assistant", "content": [{"type": "text", "text": "hi"}]}
    body.update(stop_reason="end_turn", error=None, usage={"input_tokens": 1, "output_tokens": 1})
    lake = cx.land_frames(
        tmp_path, [cx.record("messages", REQUEST, json.dumps(body).encode(), stream=False, seq=0, call_id="n")]
    )
    (row,) = cx.calls(lake)
    assert (row["status"], row["error"], row["finish_reason"]) == ("ok", None, "stop")


def test_usage_given_only_by_the_final_message_delta_is_the_call_s_usage(tmp_path: Path) -> None:
    start = {"id": "msg_u", "type": "message", "role": "assistant", "model": "claude-x", "content": []}
    events = [
        {"type": "message_start", "message": start},
        _block(0, {"type": "text", "text": ""}),
        _delta(0, {"type": "text_delta", "text": "hi"}),
        _stop(0),
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn"},
            "usage": {"input_tokens": 12, "output_tokens": 3},
        },
        {"type": "message_stop"},
    ]
    lake = cx.land_frames(tmp_path, [cx.record("messages", REQUEST, cx.sse(events), stream=True, seq=0, call_id="u")])
    (row,) = cx.calls(lake)
    assert (row["prompt_tokens"], row["completion_tokens"], row["finish_reason"]) == (12, 3, "stop")
