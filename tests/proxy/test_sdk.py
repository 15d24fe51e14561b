"""Real SDK clients (openai sync/async, anthropic) through the proxy to a scripted upstream on loopback."""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai

from tests.proxy.conftest import ProxyHandle
from tests.support.upstream import ScriptedUpstream, render_prompt, say, tool_call

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def _sse_data(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]


def test_openai_sync_tool_call_then_text_is_captured_token_exact(proxy: ProxyHandle, upstream: ScriptedUpstream):
    upstream.push(tool_call("get_weather", {"city": "Paris"}), say("Sunny in Paris."))
    client = openai.OpenAI(base_url=proxy.openai_base("r1"), api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, temperature=0.5)
    call = first.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    msgs += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    second = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
    assert second.choices[0].message.content == "Sunny in Paris."
    assert second.usage.completion_tokens == len(b"Sunny in Paris.")

    recs = proxy.records()
    assert [r.header["seq"] for r in recs] == [0, 1]
    for rec, sent in zip(recs, upstream.requests, strict=True):
        h = rec.header
        assert (h["run_id"], h["iteration"], h["rollout_id"]) == ("run1", 0, "r1")
        assert (h["api"], h["status"], h["http_status"], h["token_source"]) == ("chat", "ok", 200, "upstream")
        assert h["request_changes"] == {"added": {"return_token_ids": True, "logprobs": True}}
        original = json.loads(rec.request)
        assert "return_token_ids" not in original  # the harness's request as sent
        forwarded = sent.json()
        assert forwarded == {**original, "return_token_ids": True, "logprobs": True}
        body = json.loads(rec.response)
        assert body["prompt_token_ids"] == list(render_prompt("chat", original).encode())
        assert len(body["choices"][0]["logprobs"]["content"]) == len(body["choices"][0]["token_ids"])
    assert json.loads(recs[0].request)["tools"] == TOOLS


def test_openai_sync_stream_passthrough_and_raw_capture(proxy: ProxyHandle, upstream: ScriptedUpstream):
    upstream.push(say("Hello there, streaming world!"))
    client = openai.OpenAI(base_url=proxy.openai_base("r2"), api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello there, streaming world!"
    assert chunks[-1].usage.completion_tokens == len(text)
    (rec,) = proxy.records()
    assert rec.header["stream"] is True and rec.header["status"] == "ok"
    assert rec.response.endswith(b"data: [DONE]\n\n")
    events = _sse_data(rec.response)
    ids = [i for e in events for c in e.get("choices", []) for i in c.get("token_ids", [])]
    assert bytes(ids).decode() == text
    assert events[0]["prompt_token_ids"]


def test_openai_async_stream_and_not_with_tools(proxy: ProxyHandle, upstream: ScriptedUpstream):
    upstream.push(tool_call("get_weather", {"city": "Oslo"}), tool_call("get_weather", {"city": "Rome"}, text="ok"))

    async def run() -> tuple:
        client = openai.AsyncOpenAI(base_url=proxy.openai_base("r3"), api_key="x", max_retries=0)
        a = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Oslo"}], tools=TOOLS)
        s = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Rome"}], tools=TOOLS, stream=True
        )
        deltas = [c async for c in s]
        await client.close()
        return a, deltas

    a, deltas = asyncio.run(run())
    assert json.loads(a.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    calls = [t for d in deltas if d.choices for t in (d.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "Rome"}
    assert deltas[-1].choices[0].finish_reason == "tool_calls"
    recs = proxy.records()
    assert [r.header["stream"] for r in recs] == [False, True]
    assert all(r.header["token_source"] == "upstream" for r in recs)


def test_openai_n_choices_and_completions_api(proxy: ProxyHandle, upstream: ScriptedUpstream):
    client = openai.OpenAI(base_url=proxy.openai_base("r4"), api_key="x", max_retries=0)
    upstream.push(say("same"))
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    upstream.push(say("completion text"))
    c = client.completions.create(model="m", prompt="Once upon", max_tokens=5)
    assert c.choices[0].text == "completion text"
    recs = proxy.records()
    assert len(json.loads(recs[0].response)["choices"]) == 3  # all choices in one record
    assert recs[1].header["api"] == "completions"
    assert recs[1].header["request_changes"] == {"added": {"return_token_ids": True, "logprobs": 1}}
    assert json.loads(recs[1].response)["prompt_token_ids"] == list(b"Once upon")


def test_anthropic_messages_stream_and_not(proxy: ProxyHandle, upstream: ScriptedUpstream):
    upstream.push(tool_call("get_weather", {"city": "Lima"}, text="Let me check."), say("Cloudy."))
    client = anthropic.Anthropic(base_url=proxy.anthropic_base("ra"), api_key="x", max_retries=0)
    tools = [{"name": "get_weather", "description": "w", "input_schema": {"type": "object"}}]
    m = client.messages.create(
        model="m", max_tokens=50, system="be brief", tools=tools, messages=[{"role": "user", "content": "Lima?"}]
    )
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["text", "tool_use"] and m.content[1].input == {"city": "Lima"}
    with client.messages.stream(model="m", max_tokens=50, messages=[{"role": "user", "content": "and now?"}]) as s:
        texts = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(texts) == "Cloudy." and final.content[0].text == "Cloudy."
    recs = proxy.records()
    assert [(r.header["api"], r.header["stream"]) for r in recs] == [("messages", False), ("messages", True)]
    assert recs[0].header["request_changes"] == {"added": {"return_token_ids": True}}
    whole = json.loads(recs[0].response)
    assert bytes(whole["token_ids"]).startswith(b"Let me check.")
    assert b"event: message_stop" in recs[1].response
    delta = next(e for e in _sse_data(recs[1].response) if e["type"] == "message_delta")
    assert bytes(delta["token_ids"]) == b"Cloudy."


def test_anthropic_x_api_key_with_plain_base_url(proxy: ProxyHandle, upstream: ScriptedUpstream):
    from tests.proxy.conftest import key_for

    client = anthropic.Anthropic(base_url=proxy.url, api_key=key_for("rk"), max_retries=0)
    client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    (rec,) = proxy.records()
    assert rec.header["rollout_id"] == "rk" and rec.header["path"] == "/v1/messages"
    assert "x-api-key" not in upstream.requests[0].headers  # the rollout key stays at the proxy


def test_responses_api_stream_and_not(proxy: ProxyHandle, upstream: ScriptedUpstream):
    upstream.push(say("Plain answer."), tool_call("run_shell", {"cmd": "ls"}))
    client = openai.OpenAI(base_url=proxy.openai_base("rr"), api_key="x", max_retries=0)
    r = client.responses.create(model="m", input="hello", instructions="be terse")
    assert r.output_text == "Plain answer."
    events = list(
        client.responses.create(
            model="m",
            input=[{"role": "user", "content": "list files"}],
            tools=[{"type": "function", "name": "run_shell", "parameters": {"type": "object"}}],
            stream=True,
        )
    )
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].name == "run_shell"
    recs = proxy.records()
    assert [r.header["api"] for r in recs] == ["responses", "responses"]
    done = next(e for e in _sse_data(recs[1].response) if e["type"] == "response.completed")
    assert done["response"]["prompt_token_ids"] and done["response"]["token_ids"]


def test_models_endpoint_passes_through(proxy: ProxyHandle, upstream: ScriptedUpstream):
    client = openai.OpenAI(base_url=proxy.openai_base("rm"), api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["mock-model"]
    (rec,) = proxy.records()
    assert rec.header["api"] == "models" and rec.header["method"] == "GET"


def test_policy_version_stamped_and_upstream_connections_pooled(proxy: ProxyHandle, upstream: ScriptedUpstream):
    client = openai.OpenAI(base_url=proxy.openai_base("rp"), api_key="x", max_retries=0)
    for _ in range(5):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    proxy.server.policy_version = 7
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    versions = [r.header["policy_version"] for r in proxy.records()]
    assert versions == [0, 0, 0, 0, 0, 7]
    # one keep-alive upstream connection served all six sequential calls
    peers = {r.headers.get("host") for r in upstream.requests}
    assert len(upstream.requests) == 6 and len(peers) == 1
    assert len(proxy.server._replicas[0].idle) == 1


def test_works_on_plain_asyncio_loop_without_uvloop(make_proxy, upstream: ScriptedUpstream, monkeypatch):
    from clawpipe.proxy import loop

    monkeypatch.setattr(loop, "new_event_loop", asyncio.new_event_loop)
    proxy = make_proxy([upstream.url])
    assert "uvloop" not in type(proxy.server._loop).__module__
    upstream.push(say("plain loop"), say("plain stream"))
    client = openai.OpenAI(base_url=proxy.openai_base("rl"), api_key="x", max_retries=0)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    s = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True)
    assert r.choices[0].message.content == "plain loop"
    assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == "plain stream"
    assert [x.header["status"] for x in proxy.records()] == ["ok", "ok"]
