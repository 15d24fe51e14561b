"""Histories sent back with what each API adds to its answers (thinking, server tools, citations, reasoning
items, refusals) give the template messages of the same conversation without them."""

from __future__ import annotations

from clawpipe.apis import request_messages

SEARCH_RESULT = [{"type": "web_search_result", "url": "https://w.example", "title": "W", "encrypted_content": "E"}]
CITATION = {"type": "web_search_result_location", "url": "https://w.example", "cited_text": "sun"}


def _tool_use(i: str, name: str, args: dict) -> dict:
    return {"type": "tool_use", "id": i, "name": name, "input": args}


def test_a_messages_history_with_thinking_and_a_server_search_lines_its_tool_results_up_with_its_own_calls() -> None:
    plain_turn = [{"type": "text", "text": "Sunny."}, _tool_use("t1", "ls", {}), _tool_use("t2", "cat", {"p": "a"})]
    rich_turn = [
        {"type": "thinking", "thinking": "search first", "signature": "S"},
        {"type": "redacted_thinking", "data": "D"},
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "weather"}},
        {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": SEARCH_RESULT},
        {"type": "text", "text": "Sunny.", "citations": [CITATION]},
        *plain_turn[1:],
    ]
    results = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "a"}]},
            {"type": "tool_result", "tool_use_id": "t2", "content": "boom", "is_error": True},
        ],
    }

    def body(turn: list[dict]) -> dict:
        tools = [
            {"name": "ls", "input_schema": {"type": "object"}},
            {"name": "cat", "input_schema": {"type": "object"}},
        ]
        history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": turn}, results]
        return {
            "system": "s",
            "messages": history,
            "tools": [*tools, {"type": "web_search_20250305", "name": "web_search"}],
        }

    rich, plain = request_messages("messages", body(rich_turn)), request_messages("messages", body(plain_turn))
    assert rich == plain
    messages, tools = rich
    assert [c["function"]["name"] for c in messages[2]["tool_calls"]] == ["ls", "cat"]
    assert [(m["role"], m["content"]) for m in messages[3:]] == [("tool", "a"), ("tool", "boom")]
    assert [t["function"]["name"] for t in tools] == ["ls", "cat"]


def test_a_responses_history_with_reasoning_items_and_parallel_calls_gives_one_assistant_turn() -> None:
    reasoning = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": "S"}],
        "encrypted_content": "E",
    }
    calls = [
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "sh", "arguments": "{}"},
        {"type": "function_call", "id": "fc_2", "call_id": "c2", "name": "sh", "arguments": '{"a": 1}'},
    ]
    outputs = [
        {"type": "function_call_output", "call_id": "c1", "output": "o1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "o2"}]},
    ]
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]}
    rich = request_messages("responses", {"input": [user, reasoning, *calls, *outputs]})
    plain = request_messages("responses", {"input": [user, *calls, *outputs]})
    assert rich == plain
    assert [m["role"] for m in rich[0]] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in rich[0][1]["tool_calls"]] == ["c1", "c2"]


def test_a_refusal_sent_back_is_the_assistant_turn_s_text_in_chat_and_responses() -> None:
    chat = request_messages(
        "chat",
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "refusal": "No."}]},
    )
    refusal_part = {"type": "refusal", "refusal": "No."}
    responses = request_messages(
        "responses",
        {
            "input": [
                {"role": "user", "content": "q"},
                {"type": "message", "role": "assistant", "content": [refusal_part]},
            ]
        },
    )
    assert chat == responses == ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "No."}], [])
