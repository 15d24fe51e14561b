"""The official openai and anthropic SDKs play the guessing game's tool round trip over Chat Completions,
Responses and Messages, streamed and not, against the engine and through the proxy on every key route."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

from tests.clients.conftest import (
    ANTHROPIC_ROUTES,
    ANTHROPIC_TOOL,
    CHAT_TOOL,
    FINAL_TEXT,
    MODEL,
    OPENAI_ROUTES,
    RESPONSES_TOOL,
    TOOL_RESULT,
    USER,
    Route,
)

pytestmark = [pytest.mark.clients, pytest.mark.slow]


def _openai(route: Route) -> openai.OpenAI:
    return openai.OpenAI(base_url=route.openai_base(), api_key=route.openai_key(), max_retries=0)


def _chat_turn(client: openai.OpenAI, messages: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
    """One chat call as an assistant message dict (content and tool calls), streamed deltas joined."""
    ask: dict[str, Any] = {"model": MODEL, "messages": messages, "tools": [CHAT_TOOL], "temperature": 0}
    if not stream:
        message = client.chat.completions.create(**ask).choices[0].message
        return message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
    content, calls = "", {}
    for chunk in client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(
                    tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                call["id"] += tc.id or ""
                call["function"]["name"] += (tc.function and tc.function.name) or ""
                call["function"]["arguments"] += (tc.function and tc.function.arguments) or ""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


@pytest.mark.parametrize("route", OPENAI_ROUTES, indirect=True)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_openai_chat_tool_round_trip(route: Route, stream: bool) -> None:
    client = _openai(route)
    messages: list[dict[str, Any]] = [{"role": "user", "content": USER}]
    first = _chat_turn(client, messages, stream)
    (call,) = first["tool_calls"]
    assert call["function"]["name"] == "guess" and json.loads(call["function"]["arguments"]) == {"number": 42}
    messages += [first, {"role": "tool", "tool_call_id": call["id"], "content": TOOL_RESULT}]
    second = _chat_turn(client, messages, stream)
    assert second["content"] == FINAL_TEXT and "tool_calls" not in second
    rows = route.check_captured([("chat", stream)] * 2)
    if rows:
        assert json.loads(rows[0]["tool_calls"])[0]["function"]["name"] == "guess"


@pytest.mark.parametrize("route", OPENAI_ROUTES, indirect=True)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_openai_responses_tool_round_trip(route: Route, stream: bool) -> None:
    client = _openai(route)
    ask: dict[str, Any] = {"model": MODEL, "tools": [RESPONSES_TOOL], "temperature": 0}

    def turn(items: list[Any]) -> Any:
        if not stream:
            return client.responses.create(input=items, **ask)
        with client.responses.stream(input=items, **ask) as events:
            return events.get_final_response()

    items: list[Any] = [{"role": "user", "content": USER}]
    first = turn(items)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "guess" and json.loads(call.arguments) == {"number": 42}
    items += [
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT},
    ]
    second = turn(items)
    assert second.output_text == FINAL_TEXT and second.status == "completed"
    route.check_captured([("responses", stream)] * 2)


@pytest.mark.parametrize("route", ANTHROPIC_ROUTES, indirect=True)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_anthropic_messages_tool_round_trip(route: Route, stream: bool) -> None:
    client = anthropic.Anthropic(
        base_url=route.anthropic_base(),
        api_key=route.anthropic_key(),
        default_headers=route.anthropic_headers(),
        max_retries=0,
    )
    ask: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 64,
        "tools": [ANTHROPIC_TOOL],
        "extra_body": {"temperature": 0},
    }

    def turn(messages: list[dict[str, Any]]) -> anthropic.types.Message:
        if not stream:
            return client.messages.create(messages=messages, **ask)
        with client.messages.stream(messages=messages, **ask) as events:
            return events.get_final_message()

    messages: list[dict[str, Any]] = [{"role": "user", "content": USER}]
    first = turn(messages)
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "guess" and use.input == {"number": 42}
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": TOOL_RESULT}]},
    ]
    second = turn(messages)
    assert [b.text for b in second.content if b.type == "text"] == [FINAL_TEXT]
    assert second.stop_reason == "end_turn" and second.usage.input_tokens > 0
    route.check_captured([("messages", stream)] * 2)


@pytest.mark.parametrize("route", OPENAI_ROUTES, indirect=True)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_openai_completions_with_a_list_of_prompts(route: Route, stream: bool) -> None:
    """Legacy completions with two prompts: one call, a choice per prompt, each landed with its own prompt's ids."""
    client = _openai(route)
    prompts = ["Guess my number.", "1 + 2 ="]
    ask: dict[str, Any] = {"model": MODEL, "prompt": prompts, "max_tokens": 4, "temperature": 0}
    texts: dict[int, str] = {}
    if stream:
        for chunk in client.completions.create(**ask, stream=True):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
    else:
        texts = {c.index: c.text for c in client.completions.create(**ask).choices}
    assert sorted(texts) == [0, 1]
    rows = route.check_captured([("completions", stream)] * 2)
    if rows:
        assert rows[0]["prompt_token_ids"] != rows[1]["prompt_token_ids"]


@pytest.mark.parametrize("route", OPENAI_ROUTES, indirect=True)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_openai_stored_responses_are_read_back_listed_and_deleted(route: Route, stream: bool) -> None:
    """The SDK's retrieve, input_items.list and delete of responses created with store (the default), a turn
    continuing one by previous_response_id, and models.retrieve: served as OpenAI serves them (before, each was
    a 404 "no route"); through the proxy each is forwarded and captured as a call without token ids."""
    client = _openai(route)
    ask: dict[str, Any] = {"model": MODEL, "tools": [RESPONSES_TOOL], "temperature": 0}

    def turn(**kw: Any) -> Any:
        if not stream:
            return client.responses.create(**ask, **kw)
        with client.responses.stream(**ask, **kw) as events:
            return events.get_final_response()

    first = turn(input=[{"role": "user", "content": USER}])
    (call,) = [o for o in first.output if o.type == "function_call"]
    reply = {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}
    second = turn(input=[reply], previous_response_id=first.id)
    assert second.output_text == FINAL_TEXT

    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.status == "completed" and got.model == MODEL
    assert [o.model_dump(exclude_none=True) for o in got.output] == [
        o.model_dump(exclude_none=True) for o in first.output
    ]
    assert got.usage is not None and first.usage is not None and got.usage.input_tokens == first.usage.input_tokens
    assert "prompt_token_ids" not in (got.model_extra or {})  # the engine's per-token fields stay in the capture
    own = client.responses.input_items.list(second.id).data  # its own input only, not first's
    assert [(i.type, getattr(i, "call_id", None)) for i in own] == [("function_call_output", call.call_id)]
    (message,) = client.responses.input_items.list(first.id, order="asc").data
    assert message.type == "message" and message.id and message.content[0].text == USER  # type: ignore[union-attr]
    # before: a 200 with the JSON body, which the SDK's stream read as no events at all
    with pytest.raises(openai.BadRequestError, match="'stream' is not supported when reading a stored response"):
        client.responses.retrieve(first.id, stream=True)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("no-such-model")

    deleted = client.responses.delete(first.id)
    assert deleted is None  # the SDK returns nothing for a 200 delete
    with pytest.raises(openai.NotFoundError, match=f"Response with id '{first.id}' not found"):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    assert client.responses.retrieve(second.id).output_text == FINAL_TEXT  # what continued it stays
    unstored = client.responses.create(**ask, input=[{"role": "user", "content": USER}], store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)

    rows = route.landed_calls()
    if not route.proxied:
        assert rows == []
        return
    apis = [(r["api"], r["status"], r["http_status"], r["token_source"]) for r in rows]
    read, gone = ("responses_read", "ok", 200, "none"), ("responses_read", "http_error", 404, "none")
    assert apis == [
        ("responses", "ok", 200, "upstream"),
        ("responses", "ok", 200, "upstream"),
        read,
        read,
        read,
        ("responses_read", "http_error", 400, "none"),  # stream=true
        ("models", "ok", 200, "none"),
        ("models", "http_error", 404, "none"),
        ("responses_delete", "ok", 200, "none"),
        gone,
        ("responses_delete", "http_error", 404, "none"),
        read,
        ("responses", "ok", 200, "upstream"),
        gone,
    ], apis
