"""The OpenAI Agents SDK runs an agent with one function tool through the guessing game, over Responses and
over Chat Completions, run to completion and streamed, against the engine and through the proxy: the SDK's
own loop calls the model, runs the tool and sends its result back."""

from __future__ import annotations

import asyncio
import json
from types import ModuleType
from typing import TYPE_CHECKING, Any

import openai
import pytest

from tests.clients.conftest import FINAL_TEXT, MODEL, OPENAI_ROUTES, TOOL_RESULT, USER, Route

if TYPE_CHECKING:
    import agents as agents_sdk

pytestmark = [pytest.mark.clients, pytest.mark.slow]


def _sdk() -> ModuleType:
    """The Agents SDK, imported on first use: its import takes seconds that the collection of every run would
    pay otherwise."""
    import agents

    agents.set_tracing_disabled(True)  # no trace export to a hosted service
    return agents


def _guesser(client: openai.AsyncOpenAI, api: str, calls: list[int]) -> agents_sdk.Agent:
    agents = _sdk()

    @agents.function_tool
    def guess(number: int) -> str:
        """Guess the number."""
        calls.append(number)
        return TOOL_RESULT

    model: agents_sdk.Model
    if api == "responses":
        model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    else:
        model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    # include_usage: the SDK asks a chat stream for usage only from api.openai.com unless told to
    settings = agents.ModelSettings(temperature=0, include_usage=True)
    return agents.Agent(name="guesser", tools=[guess], model=model, model_settings=settings)


async def _run(route: Route, api: str, stream: bool, calls: list[int]) -> Any:
    async with openai.AsyncOpenAI(base_url=route.openai_base(), api_key=route.openai_key(), max_retries=0) as client:
        agent = _guesser(client, api, calls)
        agents = _sdk()
        if not stream:
            return await agents.Runner.run(agent, USER, max_turns=4)
        result = agents.Runner.run_streamed(agent, USER, max_turns=4)
        kinds = [event.type async for event in result.stream_events()]
        assert "raw_response_event" in kinds  # streamed from the model, not faked
        return result


@pytest.mark.parametrize("route", OPENAI_ROUTES, indirect=True)
@pytest.mark.parametrize("stream", [False, True], ids=["run", "stream"])
@pytest.mark.parametrize("api", ["responses", "chat"])
def test_agents_sdk_runs_the_tool_and_answers(route: Route, stream: bool, api: str) -> None:
    calls: list[int] = []
    result = asyncio.run(_run(route, api, stream, calls))
    assert calls == [42]
    assert result.final_output == FINAL_TEXT
    assert len(result.raw_responses) == 2
    usage = result.context_wrapper.usage  # summed over both model calls, from the engine's usage reports
    assert usage.requests == 2 and usage.input_tokens > 0 and usage.output_tokens > 0
    assert [r.usage.output_tokens > 0 for r in result.raw_responses] == [True, True]
    route.check_captured([(api, stream)] * 2)


@pytest.mark.parametrize("route", OPENAI_ROUTES, indirect=True)
def test_agents_sdk_chains_responses_by_previous_response_id(route: Route) -> None:
    """With auto_previous_response_id the SDK sends turn two as the tool result plus the first response's id;
    the engine expands it, so the model sees the whole conversation (and the capture holds the whole prompt)."""
    calls: list[int] = []
    agents = _sdk()

    async def run() -> Any:
        async with openai.AsyncOpenAI(
            base_url=route.openai_base(), api_key=route.openai_key(), max_retries=0
        ) as client:
            agent = _guesser(client, "responses", calls)
            return await agents.Runner.run(agent, USER, max_turns=4, auto_previous_response_id=True)

    result = asyncio.run(run())
    assert calls == [42] and result.final_output == FINAL_TEXT
    rows = route.check_captured([("responses", False)] * 2)
    if rows:
        first, second = rows
        assert json.loads(second["request"])["previous_response_id"]
        # the first call's prompt and sampled answer, token for token, start the second call's prompt
        whole = first["prompt_token_ids"] + first["completion_token_ids"]
        assert second["prompt_token_ids"][: len(whole)] == whole


@pytest.mark.parametrize("route", ["direct", "url"], indirect=True)
@pytest.mark.parametrize("stream", [False, True], ids=["run", "stream"])
def test_agents_sdk_fails_an_answer_cut_by_max_tokens(route: Route, stream: bool) -> None:
    """A Responses answer cut by max_output_tokens is `incomplete` (streamed: ends with response.incomplete),
    which the SDK raises instead of taking the truncated text as the final output."""
    agents = _sdk()

    async def run() -> None:
        async with openai.AsyncOpenAI(
            base_url=route.openai_base(), api_key=route.openai_key(), max_retries=0
        ) as client:
            settings = agents.ModelSettings(temperature=0, max_tokens=3, extra_body={"ignore_eos": True})
            model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
            agent = agents.Agent(name="short", model=model, model_settings=settings)
            if not stream:
                await agents.Runner.run(agent, "hi", max_turns=2)
                return
            result = agents.Runner.run_streamed(agent, "hi", max_turns=2)
            async for _ in result.stream_events():
                pass

    with pytest.raises(agents.exceptions.ModelBehaviorError, match="max_output_tokens"):
        asyncio.run(run())
    rows = route.check_captured([("responses", stream)])
    if rows:
        assert len(rows[0]["completion_token_ids"]) == 3
