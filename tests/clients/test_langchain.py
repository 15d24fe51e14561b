"""LangChain's chat models (langchain-openai over Chat Completions and over Responses, langchain-anthropic
over Messages) play the guessing game's tool round trip with bound tools, invoked and streamed, against the
engine and through the proxy."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from tests.clients.conftest import (
    ANTHROPIC_ROUTES,
    ANTHROPIC_TOOL,
    CHAT_TOOL,
    FINAL_TEXT,
    MODEL,
    OPENAI_ROUTES,
    TOOL_RESULT,
    USER,
    Route,
)

# LangChain is imported where it is used: its import takes seconds that the collection of every run would pay.
if TYPE_CHECKING:
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import AIMessage, BaseMessage

pytestmark = [pytest.mark.clients, pytest.mark.slow]


def _turn(model: Any, messages: list[BaseMessage], stream: bool) -> AIMessage:
    if not stream:
        return model.invoke(messages)
    joined: Any = None
    for chunk in model.stream(messages):
        joined = chunk if joined is None else joined + chunk
    assert joined is not None
    return joined


def _round_trip(chat: BaseChatModel, tool: dict[str, Any], stream: bool) -> AIMessage:
    from langchain_core.messages import HumanMessage, ToolMessage

    model = chat.bind_tools([tool])
    messages: list[BaseMessage] = [HumanMessage(USER)]
    first = _turn(model, messages, stream)
    (call,) = first.tool_calls
    assert (call["name"], call["args"]) == ("guess", {"number": 42})
    messages += [first, ToolMessage(TOOL_RESULT, tool_call_id=call["id"])]
    second = _turn(model, messages, stream)
    assert second.text == FINAL_TEXT and not second.tool_calls
    return second


@pytest.mark.parametrize("route", OPENAI_ROUTES, indirect=True)
@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_langchain_openai_tool_round_trip(route: Route, stream: bool, api: str) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=MODEL,
        base_url=route.openai_base(),
        api_key=route.openai_key(),
        temperature=0,
        max_retries=0,
        use_responses_api=api == "responses",
        stream_usage=True,
    )
    second = _round_trip(chat, CHAT_TOOL, stream)
    assert second.usage_metadata is not None and second.usage_metadata["input_tokens"] > 0
    route.check_captured([(api, stream)] * 2)


@pytest.mark.parametrize("route", ANTHROPIC_ROUTES, indirect=True)
@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
def test_langchain_anthropic_tool_round_trip(route: Route, stream: bool) -> None:
    from langchain_anthropic import ChatAnthropic

    chat = ChatAnthropic(
        model=MODEL,
        base_url=route.anthropic_base(),
        api_key=route.anthropic_key(),
        default_headers=route.anthropic_headers(),
        temperature=0,
        max_tokens=64,
        max_retries=0,
    )
    second = _round_trip(chat, ANTHROPIC_TOOL, stream)
    # streamed usage too: the engine reports input tokens in message_delta
    assert second.usage_metadata is not None and second.usage_metadata["input_tokens"] > 0
    route.check_captured([("messages", stream)] * 2)


@pytest.mark.parametrize("route", ANTHROPIC_ROUTES, indirect=True)
def test_langchain_anthropic_counts_tokens(route: Route) -> None:
    """LangChain's token counting (the Messages count_tokens endpoint, with tools) agrees with the prompt the
    engine then runs; through the proxy it is captured as count_tokens without ids, beside the ids of the call."""
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import HumanMessage

    chat = ChatAnthropic(
        model=MODEL,
        base_url=route.anthropic_base(),
        api_key=route.anthropic_key(),
        default_headers=route.anthropic_headers(),
        temperature=0,
        max_tokens=64,
        max_retries=0,
    )
    messages: list[BaseMessage] = [HumanMessage(USER)]
    counted = chat.get_num_tokens_from_messages(messages, tools=[ANTHROPIC_TOOL])
    answer = chat.bind_tools([ANTHROPIC_TOOL]).invoke(messages)
    assert answer.usage_metadata is not None and counted == answer.usage_metadata["input_tokens"]
    rows = route.landed_calls()
    if route.proxied:
        assert [(r["api"], r["status"], r["token_source"]) for r in rows] == [
            ("count_tokens", "ok", "none"),
            ("messages", "ok", "upstream"),
        ]
        assert rows[0]["prompt_token_ids"] is None and len(rows[1]["prompt_token_ids"]) == counted
