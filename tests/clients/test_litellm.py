"""litellm plays the guessing game's tool round trip over Chat Completions (openai/ provider), Responses
(litellm.responses) and Messages (anthropic/ provider, which litellm translates from its chat shape), streamed
and not, against the engine and through the proxy."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.clients.conftest import (
    ANTHROPIC_ROUTES,
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


def _completion(stream: bool, messages: list[dict[str, Any]], **kw: Any) -> Any:
    """One litellm.completion call as its (non-streamed) response; a stream is rebuilt from its chunks."""
    import litellm  # here, not at the top: its import takes seconds that the collection of every run would pay

    kw.update(messages=messages, tools=[CHAT_TOOL], temperature=0, max_tokens=64, num_retries=0)
    if not stream:
        return litellm.completion(**kw)
    return litellm.stream_chunk_builder(list(litellm.completion(**kw, stream=True)), messages=messages)


def _round_trip(stream: bool, **kw: Any) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": USER}]
    first = _completion(stream, messages, **kw).choices[0].message
    (call,) = first.tool_calls
    assert call.function.name == "guess" and json.loads(call.function.arguments) == {"number": 42}
    messages += [
        {"role": "assistant", "content": first.content or "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT},
    ]
    second = _completion(stream, messages, **kw).choices[0].message
    assert second.content == FINAL_TEXT and not second.tool_calls


@pytest.mark.parametrize("route", OPENAI_ROUTES, indirect=True)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_litellm_chat_tool_round_trip(route: Route, stream: bool) -> None:
    _round_trip(stream, model=f"openai/{MODEL}", api_base=route.openai_base(), api_key=route.openai_key())
    route.check_captured([("chat", stream)] * 2)


@pytest.mark.parametrize("route", ANTHROPIC_ROUTES, indirect=True)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_litellm_anthropic_messages_tool_round_trip(route: Route, stream: bool) -> None:
    _round_trip(
        stream,
        model=f"anthropic/{MODEL}",
        api_base=route.anthropic_base(),
        api_key=route.anthropic_key(),
        extra_headers=route.anthropic_headers(),
    )
    route.check_captured([("messages", stream)] * 2)


@pytest.fixture(scope="module")
def registered_model() -> None:
    """litellm fakes a Responses stream (one non-streamed call) for a model missing from its price list; the
    served name registered with native streaming makes it stream for real."""
    import litellm

    litellm.register_model(
        {f"openai/{MODEL}": {"litellm_provider": "openai", "mode": "responses", "supports_native_streaming": True}}
    )


@pytest.mark.parametrize("route", OPENAI_ROUTES, indirect=True)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_litellm_responses_tool_round_trip(route: Route, stream: bool, registered_model: None) -> None:
    import litellm

    ask: dict[str, Any] = {
        "model": f"openai/{MODEL}",
        "api_base": route.openai_base(),
        "api_key": route.openai_key(),
        "tools": [RESPONSES_TOOL],
        "temperature": 0,
    }

    def turn(items: list[Any]) -> Any:
        if not stream:
            return litellm.responses(input=items, **ask)
        events = list(litellm.responses(input=items, stream=True, **ask))
        assert events[-1].type == "response.completed"
        return events[-1].response

    items: list[Any] = [{"role": "user", "content": USER}]
    first = turn(items)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "guess" and json.loads(call.arguments) == {"number": 42}
    items += [
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT},
    ]
    second = turn(items)
    texts = [c.text for o in second.output if o.type == "message" for c in o.content]
    assert texts == [FINAL_TEXT]
    route.check_captured([("responses", stream)] * 2)


@pytest.mark.parametrize("route", ["direct", "url"], indirect=True)
def test_litellm_maps_unknown_model_names_to_not_found(route: Route) -> None:
    """An unserved model name is a 404 in each API's error shape, which litellm maps to its NotFoundError for
    both providers, with the engine's message naming the served names; the proxy captures both calls."""
    import litellm

    ask: dict[str, Any] = {"messages": [{"role": "user", "content": USER}], "max_tokens": 4, "num_retries": 0}
    with pytest.raises(litellm.NotFoundError, match=f"does not exist: this server serves {MODEL}"):
        litellm.completion(model="openai/gpt-4o", api_base=route.openai_base(), api_key=route.openai_key(), **ask)
    with pytest.raises(litellm.NotFoundError, match=f"does not exist: this server serves {MODEL}"):
        litellm.completion(
            model="anthropic/claude-x", api_base=route.anthropic_base(), api_key=route.anthropic_key(), **ask
        )
    rows = route.landed_calls()
    if route.proxied:
        assert [(r["api"], r["status"], r["http_status"]) for r in rows] == [
            ("chat", "http_error", 404),
            ("messages", "http_error", 404),
        ]
