"""Real SDK clients -> the real capture proxy -> a scripted vLLM-style upstream; then land the captures.

Every API, streamed and not, must land with the ids the upstream sampled, their logprobs, the finish
reason and the tool calls, exactly as the SDK saw them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from clawpipe.keys import mint_key
from clawpipe.lake import land, run_audits, run_sql
from clawpipe.proxy import ProxyServer
from tests.lake import fixtures as fx
from tests.support.upstream import ScriptedUpstream, say, tool_call

SECRET = b"lake-e2e"
TEXT = "Same answer."


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[ProxyServer, ScriptedUpstream, Path]]:
    up = ScriptedUpstream().start()
    cap = tmp_path / "captures"
    proxy = ProxyServer(upstreams=[up.url], capture_dir=cap, secret=SECRET, admin_token="admin")
    proxy.start()
    try:
        yield proxy, up, cap
    finally:
        proxy.stop(drain_timeout_s=5)
        up.stop()


@pytest.mark.slow
def test_every_api_through_the_proxy_lands_token_exact(
    stack: tuple[ProxyServer, ScriptedUpstream, Path], tmp_path: Path
):
    proxy, up, cap = stack
    key = mint_key(SECRET, run_id="e2e", iteration=0, rollout_id="ro1")
    oai = openai.OpenAI(base_url=f"{proxy.url}/r/{key}/v1", api_key="x", max_retries=0)
    ant = anthropic.Anthropic(base_url=f"{proxy.url}/r/{key}", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    up.push(*[say(TEXT)] * 8, tool_call("get_weather", {"city": "Oslo"}))
    oai.chat.completions.create(model="m", messages=msgs)
    list(oai.chat.completions.create(model="m", messages=msgs, stream=True, stream_options={"include_usage": True}))
    oai.completions.create(model="m", prompt="hi", max_tokens=20)
    list(oai.completions.create(model="m", prompt="hi", max_tokens=20, stream=True))
    ant.messages.create(model="m", max_tokens=50, messages=msgs)
    with ant.messages.stream(model="m", max_tokens=50, messages=msgs) as s:
        s.get_final_message()
    oai.responses.create(model="m", input="hi")
    list(oai.responses.create(model="m", input="hi", stream=True))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    oai.chat.completions.create(model="m", messages=msgs, tools=tools)
    fx.write_results(cap, [fx.rollout_row("ro1", run_id="e2e")])

    lake = tmp_path / "lake"
    rep = land(cap, lake)
    assert (rep.calls, rep.rejects, rep.rollouts) == (9, 0, 1), rep.as_dict()
    rows = run_sql(lake, "select * from model_calls order by seq").to_pylist()
    order = ("chat", "completions", "messages", "responses")
    assert [(r["api"], r["stream"]) for r in rows[:8]] == [(a, s) for a in order for s in (False, True)]
    for r in rows[:8]:
        where = (r["api"], r["stream"])
        assert bytes(r["completion_token_ids"]) == TEXT.encode(), where
        assert len(r["completion_logprobs"]) == len(TEXT), where
        assert r["prompt_token_ids"], where
        assert (r["finish_reason"], r["token_source"], r["status"], r["tool_calls"]) == ("stop", "upstream", "ok", None)
        assert r["completion_tokens"] == len(TEXT), where
        json.loads(r["response"])
    tool_row = rows[8]
    assert tool_row["finish_reason"] == "tool_calls"
    (tc,) = json.loads(tool_row["tool_calls"])
    assert (tc["type"], tc["function"]["name"], json.loads(tc["function"]["arguments"])) == (
        "function",
        "get_weather",
        {"city": "Oslo"},
    )
    assert {k: v.num_rows for k, v in run_audits(lake).items()} == dict.fromkeys(run_audits(lake), 0)
    assert land(cap, lake).calls == 0
