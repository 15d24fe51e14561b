"""The tests' one fake upstream speaks every dialect alike: a streamed answer reassembles (clawpipe.apis) into
the body the same answer has unstreamed, and a follow-up turn's prompt ids extend prompt + completion."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from clawpipe.apis import read_events, reassemble
from tests.support.upstream import ScriptedUpstream, shell_then_reply, tool_call

PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
SHELL = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
TOOLS = {
    "chat": [{"type": "function", "function": {"name": "sh", "parameters": SHELL}}],
    "responses": [{"type": "function", "name": "sh", "parameters": SHELL}],
    "messages": [{"name": "sh", "input_schema": SHELL}],
}


def _first(api: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "tools": TOOLS[api], "return_token_ids": True, "max_tokens": 9}
    if api == "responses":
        body["input"] = "list files"
    else:
        body["messages"] = [{"role": "user", "content": "list files"}]
    return body


def _follow_up(api: str, first: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """The first request, plus the assistant's tool call and its result, as a client would send them."""
    args = json.dumps(answer["args"])
    if api == "chat":
        call = {"id": "c1", "type": "function", "function": {"name": answer["name"], "arguments": args}}
        turns = [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        ]
        return {**first, "messages": first["messages"] + turns}
    if api == "messages":
        use = {"type": "tool_use", "id": "t1", "name": answer["name"], "input": answer["args"]}
        result = {"type": "tool_result", "tool_use_id": "t1", "content": "a.txt"}
        turns = [{"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
        return {**first, "messages": first["messages"] + turns}
    items = [
        {"type": "message", "role": "user", "content": "list files"},
        {"type": "function_call", "call_id": "c1", "name": answer["name"], "arguments": args},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
    ]
    return {**first, "input": items}


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_streamed_answer_reassembles_to_the_unstreamed_body(api: str) -> None:
    answer = tool_call("sh", {"command": "ls"}, text="Let me look.")
    with ScriptedUpstream([answer], chunk_chars=3) as up:  # one server per call: both are its call 1 (same ids)
        whole = httpx.post(up.url + PATHS[api], json=_first(api)).json()
    with ScriptedUpstream([answer], chunk_chars=3) as up:
        r = httpx.post(up.url + PATHS[api], json={**_first(api), "stream": True})
    events = [json.loads(ev.data) for ev in read_events(r.content) if ev.data != b"[DONE]"]
    streamed = reassemble(api, events)
    if api == "chat":
        for key in ("message", "finish_reason", "token_ids"):
            assert streamed["choices"][0][key] == whole["choices"][0][key], key
        assert streamed["prompt_token_ids"] == whole["prompt_token_ids"]
    elif api == "messages":
        for key in ("content", "stop_reason", "token_ids", "prompt_token_ids"):
            assert streamed[key] == whole[key], key
    else:
        assert {k: v for k, v in streamed.items() if k != "id"} == {k: v for k, v in whole.items() if k != "id"}


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_shell_rule_calls_the_tool_once_and_the_follow_up_prompt_extends_the_first(api: str) -> None:
    with ScriptedUpstream(default=shell_then_reply("ls", reply="done")) as up:
        first = _first(api)
        httpx.post(up.url + "/r/some-key" + PATHS[api], json=first).raise_for_status()
        httpx.post(up.url + "/r/some-key" + PATHS[api], json=_follow_up(api, first, up.answers[0])).raise_for_status()
    one, two = up.answers
    assert (one["kind"], one["name"], one["args"]) == ("tool", "sh", {"command": "ls"})
    assert (two["kind"], two["text"]) == ("text", "done")
    sampled = one["prompt_token_ids"] + one["token_ids"]
    assert two["prompt_token_ids"][: len(sampled)] == sampled and len(two["prompt_token_ids"]) > len(sampled)
    assert [r.path for r in up.model_requests()] == ["/r/some-key" + PATHS[api]] * 2
