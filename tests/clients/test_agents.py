"""The OpenAI Agents SDK runs an agent with one function tool through the guessing game, over Responses and
over Chat Completions, run to completion and streamed, against the engine and through the proxy: the SDK's
own loop calls the model, runs the tool and sends its result back."""

from __future__ import annotations

import asyncio
from typing import Any

import agents
import openai
import pytest

from tests.clients.conftest import FINAL_TEXT, MODEL, OPENAI_ROUTES, TOOL_RESULT, USER, Route

pytestmark = pytest.mark.clients

agents.set_tracing_disabled(True)  # no trace export to a hosted service


def _guesser(client: openai.AsyncOpenAI, api: str, calls: list[int]) -> agents.Agent:
    @agents.function_tool
    def guess(number: int) -> str:
        """Guess the number."""
        calls.append(number)
        return TOOL_RESULT

    model: agents.Model
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
