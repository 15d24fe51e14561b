"""Anthropic Messages through the anthropic SDK, including everything Claude Code sends."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

from tests.serving.conftest import FINAL_TEXT, TOOLS, USER

GREEDY = {"temperature": 0}  # the 2.x SDK has no temperature argument; the API still takes it
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]


@pytest.fixture
def client(server: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0)


def test_messages_non_stream_and_stream_carry_ids_and_logprobs(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="tiny", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    extra = m.model_extra or {}
    assert extra["prompt_token_ids"] and extra["policy_version"] == 0
    assert len(extra["token_ids"]) == len(extra["logprobs"]["content"]) == m.usage.output_tokens
    assert m.stop_reason in ("end_turn", "max_tokens") and m.content[0].type == "text"
    with client.messages.stream(model="tiny", max_tokens=10, messages=[{"role": "user", "content": "hi"}]) as s:
        events = list(s)
        final = s.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and "message_delta" in kinds and kinds[-1] == "message_stop"
    start = next(e for e in events if e.type == "message_start")
    assert start.message.model_extra["prompt_token_ids"] == extra["prompt_token_ids"]
    delta = next(e for e in events if e.type == "message_delta")
    assert len(delta.model_extra["token_ids"]) == final.usage.output_tokens


def test_claude_code_shaped_request_is_accepted(server: Any) -> None:
    """?beta=true, beta headers, a system role inside messages, thinking, context_management, output_config,
    cache_control, metadata and server tools: accepted and ignored where the engine cannot honour them."""
    body = {
        "model": "tiny",
        "max_tokens": 64,
        "stream": True,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=abc;"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "system", "content": "Extra system reminder."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                    {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                ],
            },
        ],
        "tools": [
            {**ANTHROPIC_TOOLS[0], "cache_control": {"type": "ephemeral"}},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        ],
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "user_abc_account__session_1"},
        "temperature": 1,
    }
    headers = {
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27",
        "anthropic-version": "2023-06-01",
        "x-api-key": "k",
        "x-app": "cli",
    }
    with httpx.Client(timeout=60) as c:
        r = c.post(f"{server.url}/v1/messages?beta=true", json=body, headers=headers)
        assert r.status_code == 200, r.text
        assert "event: message_stop" in r.text
        count = c.post(f"{server.url}/v1/messages/count_tokens?beta=true", json=body, headers=headers)
        assert count.status_code == 200 and count.json()["input_tokens"] > 20


def test_messages_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    first = client.messages.create(
        model="tiny",
        max_tokens=64,
        extra_body=GREEDY,
        tools=ANTHROPIC_TOOLS,
        messages=[{"role": "user", "content": USER}],
    )
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "guess" and use.input == {"number": 42} and use.id.startswith("toolu_")
    second = client.beta.messages.create(
        model="tiny",
        max_tokens=64,
        extra_body=GREEDY,
        tools=ANTHROPIC_TOOLS,
        betas=["interleaved-thinking-2025-05-14"],
        messages=[
            {"role": "user", "content": USER},
            {"role": "assistant", "content": [b.model_dump() for b in first.content if b.type == "tool_use"]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "correct"}]},
        ],
    )
    assert [b.text for b in second.content if b.type == "text"] == [FINAL_TEXT]
    assert second.stop_reason == "end_turn"
    with client.messages.stream(
        model="tiny",
        max_tokens=64,
        extra_body=GREEDY,
        tools=ANTHROPIC_TOOLS,
        messages=[{"role": "user", "content": USER}],
    ) as s:
        final = s.get_final_message()
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [("tool_use", {"number": 42})]
    assert final.stop_reason == "tool_use"


def test_messages_bad_input_is_a_400_in_anthropic_shape(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="tiny", max_tokens=10, messages=[{"role": "robot", "content": "x"}])
    assert "role user, assistant or system" in str(err.value)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(
            model="tiny", max_tokens=10, messages=[{"role": "user", "content": "x"}], tools=[{"name": 3}]
        )
    assert "tools[0]" in str(err.value)
