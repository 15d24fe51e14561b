"""Fidelity to the real APIs, as their SDKs see it: Responses previous_response_id and response.incomplete,
Anthropic stream usage, legacy completions with a list of prompts, served model names and every error in the
API's own shape, and policy_version on every response body."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.serving.conftest import FINAL_TEXT, TOOLS, USER

TOOL = {"type": "function", "name": "guess", **{k: v for k, v in TOOLS[0]["function"].items() if k != "name"}}


@pytest.fixture
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0)


def _events(r: httpx.Response) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) of each SSE event of a response body."""
    out = []
    for block in r.text.split("\n\n"):
        lines = block.splitlines()
        name = next((line[7:] for line in lines if line.startswith("event: ")), None)
        data = "".join(line[6:] for line in lines if line.startswith("data: "))
        if data and data != "[DONE]":
            out.append((name, json.loads(data)))
    return out


# ---------------------------------------------------------------- Responses


def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI) -> None:
    """Turn two sends only the tool result and previous_response_id; the engine expands it to the first turn's
    input and output (as OpenAI does), so the scripted policy sees the whole conversation and answers."""
    first = client.responses.create(model="tiny", input=USER, tools=[TOOL], temperature=0)
    (call,) = [o for o in first.output if o.type == "function_call"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "correct"}
    second = client.responses.create(
        model="tiny", previous_response_id=first.id, input=[result], tools=[TOOL], temperature=0
    )
    assert second.output_text == FINAL_TEXT
    assert second.previous_response_id == first.id
    extra, first_extra = second.model_extra or {}, first.model_extra or {}
    prefix = first_extra["prompt_token_ids"]
    assert extra["prompt_token_ids"][: len(prefix)] == prefix  # the first turn is in the second's prompt
    # a streamed first turn is kept too
    streamed = list(client.responses.create(model="tiny", input=USER, tools=[TOOL], temperature=0, stream=True))
    after_stream = client.responses.create(
        model="tiny", previous_response_id=streamed[-1].response.id, input=[result], tools=[TOOL], temperature=0
    )
    assert after_stream.output_text == FINAL_TEXT


def test_unknown_or_unstored_previous_response_ids_get_a_400_saying_what_to_send(client: openai.OpenAI) -> None:
    unstored = client.responses.create(model="tiny", input=USER, tools=[TOOL], temperature=0, store=False)
    assert unstored.store is False
    for rid in ("resp_unknown", unstored.id):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model="tiny", previous_response_id=rid, input="next", max_output_tokens=2)
        body = err.value.body
        assert isinstance(body, dict) and body["code"] == "previous_response_not_found"
        assert body["param"] == "previous_response_id" and rid in body["message"]
        assert "send the whole conversation in 'input'" in body["message"]


def test_a_stream_cut_by_max_output_tokens_ends_with_response_incomplete(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model="tiny", input="hi", max_output_tokens=3, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
    )
    last = events[-1]
    assert last.type == "response.incomplete" and "response.completed" not in [e.type for e in events]
    assert last.response.status == "incomplete"
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.usage is not None and last.response.usage.output_tokens == 3
    # finished by itself: response.completed
    done = list(client.responses.create(model="tiny", input="hi", max_output_tokens=50, temperature=0, stream=True))
    assert done[-1].type == "response.completed" and done[-1].response.status == "completed"


# ---------------------------------------------------------------- Anthropic


def test_anthropic_streams_report_input_tokens_and_cache_fields(server: Any) -> None:
    body = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi there"}], "stream": True}
    events = _events(httpx.post(f"{server.url}/v1/messages", json=body, timeout=30))
    start = next(d for name, d in events if name == "message_start")["message"]
    delta = next(d for name, d in events if name == "message_delta")
    n_prompt = len(start["prompt_token_ids"])
    for usage in (start["usage"], delta["usage"]):
        assert usage["input_tokens"] == n_prompt > 0
        assert usage["cache_creation_input_tokens"] == 0 and usage["cache_read_input_tokens"] == 0
    assert delta["usage"]["output_tokens"] == len(delta["token_ids"])
    sdk = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0)
    with sdk.messages.stream(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "hi there"}]) as s:
        final = s.get_final_message()
    assert final.usage.input_tokens == n_prompt


# ---------------------------------------------------------------- legacy completions


def test_completions_with_a_list_of_prompts_index_choices_across_prompts(client: openai.OpenAI) -> None:
    prompts = ["1 + 2 =", "hello there"]
    ask = {"model": "tiny", "max_tokens": 5, "temperature": 0, "n": 2}
    alone = [client.completions.create(prompt=p, **ask) for p in prompts]
    both = client.completions.create(prompt=prompts, **ask)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    for i, single in enumerate(alone):
        for k in range(2):
            choice = both.choices[i * 2 + k]
            extra = choice.model_extra or {}
            assert extra["prompt_token_ids"] == (single.model_extra or {})["prompt_token_ids"]
            assert extra["token_ids"] == (single.choices[k].model_extra or {})["token_ids"]
            assert choice.text == single.choices[k].text
    assert both.usage is not None
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage is not None)
    # token-id prompts, streamed: the same texts per index
    ids = [(a.model_extra or {})["prompt_token_ids"] for a in alone]
    texts: dict[int, str] = {}
    for chunk in client.completions.create(prompt=ids, stream=True, **ask):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in both.choices}


def test_bad_prompt_lists_get_a_400_naming_the_prompt(server: Any) -> None:
    for prompt, expected in ([["ok", ""], "prompt[1]"], [[], "non-empty list"], [["ok", 3], "prompt[1]"]):
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400 and expected in r.json()["error"]["message"], (prompt, r.text)


# ---------------------------------------------------------------- model names and error shapes


def test_unknown_model_names_get_404_in_each_apis_shape(server: Any, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as chat:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.value.code == "model_not_found" and "`gpt-4o` does not exist" in chat.value.message
    assert "tiny" in chat.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other", input="hi", max_output_tokens=2)
    sdk = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as msg:
        sdk.messages.create(model="claude-x", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert msg.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": msg.value.body["error"]["message"]},  # type: ignore[index]
    }
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_several_served_names_are_listed_and_accepted(policy_dir: Path) -> None:
    from clawpipe.serving.server import start_server

    handle = start_server(policy_dir, device="cpu", admin_token="a", max_model_len=1024, served_name=["policy", "p2"])
    try:
        c = openai.OpenAI(base_url=f"{handle.url}/v1", api_key="k", max_retries=0)
        assert [m.id for m in c.models.list()] == ["policy", "p2"]
        for name in ("policy", "p2"):
            assert c.completions.create(model=name, prompt="hi", max_tokens=2).model == name
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model=policy_dir.name, prompt="hi", max_tokens=2)  # named: the folder name is not
    finally:
        handle.stop()


def test_unknown_paths_and_methods_get_the_apis_error_shape(server: Any) -> None:
    cases = {
        ("GET", "/v1/nothing"): (404, False),
        ("POST", "/v1/embeddings"): (404, False),
        ("GET", "/v1/chat/completions"): (405, False),
        ("GET", "/v1/messages"): (405, True),
        ("POST", "/v1/messages/nothing"): (404, True),
    }
    for (method, path), (status, is_anthropic) in cases.items():
        r = httpx.request(method, f"{server.url}{path}", json={})
        body = r.json()
        assert r.status_code == status and "detail" not in body, (path, body)
        if is_anthropic:
            assert body["type"] == "error" and body["error"]["type"] in ("not_found_error", "invalid_request_error")
            message = body["error"]["message"]
        else:
            assert set(body) == {"error"} and body["error"]["type"] == "invalid_request_error"
            message = body["error"]["message"]
        assert path in message, message
    assert httpx.get(f"{server.url}/v1/chat/completions").headers["allow"] == "POST"


# ---------------------------------------------------------------- policy_version everywhere


def test_every_response_body_carries_the_policy_version(server: Any) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    requests = {
        "/v1/chat/completions": {"messages": msgs, "max_tokens": 4},
        "/v1/completions": {"prompt": "hi", "max_tokens": 4},
        "/v1/responses": {"input": "hi", "max_output_tokens": 4},
        "/v1/messages": {"messages": msgs, "max_tokens": 4},
    }
    for path, body in requests.items():
        plain = httpx.post(f"{server.url}{path}", json={"model": "tiny", **body, "ignore_eos": True}, timeout=30)
        assert plain.json()["policy_version"] == 0, path
        stream = httpx.post(
            f"{server.url}{path}", json={"model": "tiny", **body, "ignore_eos": True, "stream": True}, timeout=30
        )
        events = _events(stream)
        if path in ("/v1/chat/completions", "/v1/completions"):
            carrying = [d for _, d in events]  # every chunk
        elif path == "/v1/responses":
            carrying = [d["response"] for _, d in events if "response" in d]  # created, in_progress, final
            assert events[-1][0] == "response.incomplete"
        else:
            carrying = [
                d["message"] if n == "message_start" else d
                for n, d in events
                if n in ("message_start", "message_delta")
            ]
            assert len(carrying) == 2
        assert carrying and all(d["policy_version"] == 0 for d in carrying), (path, carrying)


# ---------------------------------------------------------------- shutdown mid-stream


@pytest.mark.slow
def test_a_stream_cut_by_shutdown_ends_with_an_error_event_in_each_apis_shape(policy_dir: Path) -> None:
    """Streams of all four APIs, each past its first tokens, when the server stops: the last event of each is an
    error in that API's stream shape (so a capture of it is an error, not a short answer)."""
    import threading
    import time

    from clawpipe.serving.client import server_health
    from clawpipe.serving.server import start_server

    handle = start_server(policy_dir, device="cpu", admin_token="a", max_model_len=8192)
    msgs = [{"role": "user", "content": "hi"}]
    long = {"model": policy_dir.name, "stream": True, "ignore_eos": True, "temperature": 0}
    requests = {
        "/v1/chat/completions": {**long, "messages": msgs, "max_tokens": 6000},
        "/v1/completions": {**long, "prompt": "hi", "max_tokens": 6000},
        "/v1/responses": {**long, "input": "hi", "max_output_tokens": 6000},
        "/v1/messages": {**long, "messages": msgs, "max_tokens": 6000},
    }
    received: dict[str, list[str]] = {path: [] for path in requests}

    def stream(path: str) -> None:
        with httpx.Client(timeout=60) as c, c.stream("POST", f"{handle.url}{path}", json=requests[path]) as r:
            received[path] += list(r.iter_lines())

    threads = [threading.Thread(target=stream, args=(path,)) for path in requests]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while server_health(handle.url)["running"] < 4 or server_health(handle.url)["stats"]["tokens"] < 40:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    handle.stop()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    for path, lines in received.items():
        events = _events(httpx.Response(200, text="\n".join(lines) + "\n\n"))
        assert len(events) > 3, path  # cut mid-stream, after tokens went out
        name, last = events[-1]
        if path == "/v1/messages":
            assert name == "error" and last["type"] == "error" and last["error"]["type"] == "api_error"
            message = last["error"]["message"]
        elif path == "/v1/responses":
            assert name == "error" and last["type"] == "error" and last["code"] == "server_error"
            assert last["sequence_number"] == events[-2][1]["sequence_number"] + 1
            message = last["message"]
        else:
            assert name is None and set(last) == {"error"}
            message = last["error"]["message"]
        assert "shutting down" in message, (path, last)


def test_a_stored_responses_input_items_are_paged_as_openai_pages_them(server: Any) -> None:
    """``GET /v1/responses/ID/input_items``: newest first by default, ``limit`` items a page with ``has_more``,
    ``after`` an item id, every item typed and with an id (a plain message's text as an input_text part);
    bad paging is a 400 naming the parameter, and a deleted response a 404 in OpenAI's shape."""
    items = [{"role": "user", "content": f"turn {i}"} for i in range(5)]
    made = httpx.post(f"{server.url}/v1/responses", json={"input": items, "max_output_tokens": 2}, timeout=60)
    rid = made.json()["id"]
    url = f"{server.url}/v1/responses/{rid}/input_items"
    page = httpx.get(url, params={"limit": 2}, timeout=10).json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["turn 4", "turn 3"] and page["has_more"] is True
    assert all(i["type"] == "message" and i["id"].startswith("msg_") for i in page["data"])
    assert page["first_id"] == page["data"][0]["id"] and page["last_id"] == page["data"][1]["id"]
    rest = httpx.get(url, params={"after": page["last_id"]}, timeout=10).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["turn 2", "turn 1", "turn 0"] and not rest["has_more"]
    ascending = httpx.get(url, params={"order": "asc"}, timeout=10).json()["data"]
    assert [i["content"][0]["text"] for i in ascending] == [f"turn {i}" for i in range(5)]
    for bad, param in (({"limit": 0}, "limit"), ({"limit": "x"}, "limit"), ({"limit": "1_0"}, "limit"),
                       ({"limit": " 5"}, "limit"), ({"limit": "9" * 5000}, "limit"), ({"order": "up"}, "order"),
                       ({"after": "msg_nope"}, "after")):  # fmt: skip
        r = httpx.get(url, params=bad, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    assert httpx.get(f"{server.url}/v1/responses/{rid}", timeout=10).json()["output"] == made.json()["output"]
    gone = httpx.delete(f"{server.url}/v1/responses/{rid}", timeout=10)
    assert gone.json() == {"id": rid, "object": "response.deleted", "deleted": True}
    for method, path in (
        ("GET", f"/v1/responses/{rid}"),
        ("DELETE", f"/v1/responses/{rid}"),
        ("GET", url[len(server.url) :]),
    ):
        r = httpx.request(method, server.url + path, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", (method, path, r.text)
