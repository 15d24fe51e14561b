"""The OpenAI surfaces (Chat Completions, Completions, Responses) through the openai SDK, as harnesses use them."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from clawpipe.serving.policy import load_tokenizer
from tests.serving.conftest import FINAL_TEXT, FIRST_TURN, SECOND_TURN, TOOLS, USER

IDS = {"return_token_ids": True}


@pytest.fixture
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0)


def test_chat_non_stream_returns_ids_logprobs_and_policy_version(client: openai.OpenAI, scripted_dir: Any) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=12, logprobs=True, extra_body=IDS
    )
    body = r.model_dump()
    tok = load_tokenizer(scripted_dir)
    assert body["prompt_token_ids"] == tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True, return_dict=False
    )
    choice = body["choices"][0]
    ids = choice["token_ids"]
    assert 0 < len(ids) <= 12 and r.usage.completion_tokens == len(ids)
    entries = choice["logprobs"]["content"]
    assert len(entries) == len(ids) and all(e["logprob"] <= 0 and isinstance(e["bytes"], list) for e in entries)
    assert body["policy_version"] == 0
    if choice["finish_reason"] == "length":
        assert r.choices[0].message.content == tok.decode(ids)


def test_chat_stream_carries_ids_per_chunk_and_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=10,
            stream=True,
            logprobs=True,
            stream_options={"include_usage": True},
            extra_body=IDS,
        )
    )
    first = chunks[0].model_dump()
    assert first["prompt_token_ids"] and first["policy_version"] == 0
    ids = [t for c in chunks for ch in c.choices for t in (ch.model_extra or {}).get("token_ids", [])]
    lps = [e.logprob for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content or []]
    assert len(ids) == len(lps) == chunks[-1].usage.completion_tokens
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] in (["length"], ["stop"])


def test_n_greater_than_one_returns_n_choices(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, n=3, seed=1, extra_body=IDS
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    seqs = [tuple(c.model_extra["token_ids"]) for c in r.choices]
    assert len(set(seqs)) > 1
    streamed = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, n=3, seed=1, stream=True
        )
    )
    by_index: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    for c in streamed:
        for ch in c.choices:
            by_index.setdefault(ch.index, []).extend((ch.model_extra or {}).get("token_ids", []))
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    assert [tuple(by_index[i]) for i in range(3)] == seqs  # same seed, same samples, streamed or not
    # incremental text (partial UTF-8 held back) adds up to the non-streamed text
    assert [texts[i] for i in range(3)] == [c.message.content for c in r.choices]


def test_chat_tool_call_round_trip(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model="tiny", messages=FIRST_TURN, tools=TOOLS, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    named = {"type": "function", "function": {"name": "guess"}}
    same = client.chat.completions.create(
        model="tiny", messages=FIRST_TURN, tools=TOOLS, temperature=0, tool_choice=named
    )
    assert same.choices[0].finish_reason == "tool_calls"  # auto, required and a named tool offer the tools
    unoffered = client.chat.completions.create(
        model="tiny", messages=FIRST_TURN, tools=TOOLS, temperature=0, tool_choice="none", extra_body=IDS
    )
    assert not unoffered.choices[0].message.tool_calls and unoffered.choices[0].finish_reason != "tool_calls"
    assert len(unoffered.model_extra["prompt_token_ids"]) < len(first.model_extra["prompt_token_ids"])
    (call,) = choice.message.tool_calls
    assert call.function.name == "guess" and json.loads(call.function.arguments) == {"number": 42}
    history = [
        *FIRST_TURN,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "correct"},
    ]
    second = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, temperature=0, extra_body=IDS)
    assert second.choices[0].message.content == FINAL_TEXT
    assert second.choices[0].finish_reason == "stop"
    # the follow-up's prompt extends the first call's prompt + its sampled ids (no re-tokenization drift)
    p1, c1 = first.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    assert second.model_extra["prompt_token_ids"][: len(p1) + len(c1)] == p1 + c1
    # streamed: the call arrives as tool_calls deltas, no <tool_call> text leaks into content
    chunks = list(
        client.chat.completions.create(model="tiny", messages=FIRST_TURN, tools=TOOLS, temperature=0, stream=True)
    )
    text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    deltas = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []]
    assert "<tool_call>" not in text and [d.function.name for d in deltas] == ["guess"]
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]


def test_completions_with_text_and_id_prompts(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="1 + 2 =", max_tokens=6, logprobs=1, extra_body=IDS)
    body = r.model_dump()
    ids = body["choices"][0]["token_ids"]
    lp = body["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(lp["content"]) == len(ids) > 0
    again = client.completions.create(model="tiny", prompt=body["prompt_token_ids"], max_tokens=6, temperature=0)
    assert again.model_extra["prompt_token_ids"] == body["prompt_token_ids"]
    streamed = list(client.completions.create(model="tiny", prompt="1 + 2 =", max_tokens=6, stream=True))
    assert sum(len((c.choices[0].model_extra or {}).get("token_ids", [])) for c in streamed if c.choices) > 0


def _codex_body(stream: bool) -> dict[str, Any]:
    """Shaped like Codex CLI's requests: developer instructions, include, store false, hosted tools, cache key."""
    return {
        "model": "tiny",
        "instructions": "You are a coding agent.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: none."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        ],
        "tools": [
            {
                "type": "function",
                "name": "shell",
                "description": "Run",
                "strict": False,
                "parameters": {"type": "object"},
            },
            {"type": "web_search"},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": stream,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "abc",
        "client_metadata": {"x": "y"},
        "max_output_tokens": 12,
        "seed": 0,
    }


def test_responses_stream_emits_the_event_sequence_codex_expects(server: Any, client: openai.OpenAI) -> None:
    body = {k: v for k, v in _codex_body(True).items() if k not in ("client_metadata", "seed")}
    events = list(client.responses.create(**body, extra_body={"seed": 0}))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    done = events[-1].response
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if done.status == "incomplete" else "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response.model_dump()
    assert done["token_ids"] and len(done["logprobs"]["content"]) == len(done["token_ids"])
    assert done["prompt_token_ids"] and done["output"][0]["content"][0]["text"] == "".join(
        e.delta for e in events if e.type == "response.output_text.delta"
    )
    assert events[0].response.model_extra["policy_version"] == 0
    # raw body as Codex sends it (client_metadata included) is accepted too
    r = httpx.post(f"{server.url}/v1/responses", json=_codex_body(False), timeout=30)
    assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete")


def test_responses_function_call_round_trip(client: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "guess", **{k: v for k, v in TOOLS[0]["function"].items() if k != "name"}}
    first = client.responses.create(model="tiny", input=USER, tools=[tool], temperature=0)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "guess" and json.loads(call.arguments) == {"number": 42}
    follow = [
        {"role": "user", "content": USER},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "correct"},
    ]
    second = client.responses.create(model="tiny", input=follow, tools=[tool], temperature=0)
    assert second.output_text == FINAL_TEXT
    streamed = list(client.responses.create(model="tiny", input=USER, tools=[tool], temperature=0, stream=True))
    kinds = [e.type for e in streamed]
    assert "response.function_call_arguments.done" in kinds and "response.output_text.delta" not in kinds
    final = streamed[-1].response
    assert [o.type for o in final.output] == ["function_call"] and final.output[0].name == "guess"


def test_bad_requests_get_400_with_a_clear_message_and_serving_continues(server: Any, client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "x"}]
    cases = [
        ({"messages": msgs, "max_tokens": 10_000}, "beyond the limit"),
        ({"messages": [{"role": "user", "content": "word " * 5000}]}, "context overflow"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": "hello"}, "'messages' must be"),
        ({"messages": [{"role": "user", "content": 5}]}, "content must be"),
        (
            {"messages": msgs, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "JSON Schema",
        ),
        ({"messages": msgs, "tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"messages": msgs, "temperature": "hot"}, "'temperature' must be a number"),
        ({"messages": msgs, "stream": "false"}, "'stream' must be true or false"),
        ({"messages": msgs, "stream": True, "stream_options": "yes"}, "'stream_options' must be an object"),
        ({"messages": msgs, "n": 0}, "n must be in [1, 128]"),
        ({"messages": msgs, "logprobs": "no"}, "'logprobs' must be true or false"),
        ({"messages": msgs, "model": {"x": 1}}, "'model' must be a string"),
        ({"messages": msgs, "tool_choice": 5}, "'tool_choice' must be"),
        ({"messages": msgs, "logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20]"),
        ({"messages": msgs, "tool_choice": "required"}, "needs at least one tool"),
        (
            {"messages": msgs, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not one of the request's tools ['guess']",
        ),
    ]
    for body, message in cases:
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", **body}, timeout=30)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)
    for raw in (b"{nope", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', b"[" * 5000 + b"]" * 5000):
        bad_json = httpx.post(f"{server.url}/v1/chat/completions", content=raw, timeout=10)
        assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    legacy = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": False})
    assert legacy.status_code == 200 and legacy.json()["choices"][0]["logprobs"] is None
    assert client.chat.completions.create(model="tiny", messages=msgs, max_tokens=3).choices[0].message is not None


def test_models_and_health(server: Any, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_second_turn_prompt_is_the_scripted_conversation(scripted_dir: Any, client: openai.OpenAI) -> None:
    """The chat API renders SECOND_TURN exactly as the imprinting did (guards the round-trip tests above)."""
    tok = load_tokenizer(scripted_dir)
    r = client.chat.completions.create(model="tiny", messages=SECOND_TURN, tools=TOOLS, max_tokens=1, extra_body=IDS)
    assert r.model_extra["prompt_token_ids"] == tok.apply_chat_template(
        SECOND_TURN, tools=TOOLS, tokenize=True, add_generation_prompt=True, return_dict=False
    )


def test_accepted_connections_send_without_nagle_delay(server: Any) -> None:
    """Headers and body leave in two writes; without TCP_NODELAY the body waits ~40 ms for the client's delayed
    ACK on every response. The server's connections must have it set, on uvicorn's loop and on plain asyncio."""
    import socket

    from clawpipe.serving.server import listen_socket
    from tests.support.net import accepted_nodelay

    assert accepted_nodelay(listen_socket("127.0.0.1", 0)) != 0

    assert server._server is not None
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        conns = list(server._server.server_state.connections)
        assert conns, "the server holds the keep-alive connection"
        for proto in conns:
            sock = proto.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_top_logprobs_are_the_most_likely_tokens_in_order(client: openai.OpenAI, server: Any) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    entries = r.choices[0].logprobs.content
    assert entries
    for e in entries:
        top = [t.logprob for t in e.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True)
        assert e.top_logprobs[0].token == e.token and abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6  # greedy
    legacy = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "logprobs": 2, "temperature": 0}
    ).json()["choices"][0]["logprobs"]
    assert len(legacy["top_logprobs"]) == len(legacy["tokens"]) and all(
        1 <= len(d) <= 2 for d in legacy["top_logprobs"]
    )
