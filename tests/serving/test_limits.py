"""The engine's limits under clients that push them: body size, prompt length before tokenizing, JSON
nesting, stored responses, a long prompt's tokenizing beside other streams, clients hanging up, and reloads
(diverged weights, one at a time, cut by shutdown). Each ends in a 4xx/503 in the API's own shape or keeps
serving, never a 500, an out-of-memory kill or a wedged engine."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serving.calls import MSGS, error_message, post, stream_events, strict


@pytest.fixture(scope="module")
def small_body_server(policy_dir: Path) -> Iterator[Any]:
    """An engine that takes request bodies up to 64 KiB and prompts up to 100 tokens."""
    from clawpipe.serving.server import start_server

    handle = start_server(
        policy_dir, device="cpu", served_name="tiny", max_model_len=4096, max_request_mb=1 / 16, max_prompt_tokens=100
    )
    yield handle
    handle.stop()


def test_a_body_over_the_size_limit_is_a_413_in_each_apis_shape_before_it_is_read(small_body_server: Any) -> None:
    from clawpipe.serving.body import MAX_REQUEST_BYTES
    from clawpipe.serving.routes import ServeOptions

    assert ServeOptions().max_request_bytes == MAX_REQUEST_BYTES == 32 * 2**20
    url = small_body_server.url
    huge = [{"role": "user", "content": "word " * 20_000}]  # 100 kB: a context overflow, were it read
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": huge}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert "limit of 65536 bytes" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/messages", json={"messages": huge, "max_tokens": 2}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is counted as the body arrives
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(20):
            yield b"word " * 1000
        yield b'"}]}'

    r = httpx.post(f"{url}/v1/chat/completions", content=chunks(), timeout=30)
    assert r.status_code == 413 and "over this server's limit" in r.json()["error"]["message"], r.text
    ok = httpx.post(  # ignore_eos: end-of-turn drawn first would end the answer early
        f"{url}/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "ignore_eos": True}, timeout=30
    )
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2


def test_prompt_text_too_long_for_any_tokenization_is_refused_before_it_is_tokenized(
    server: Any, small_body_server: Any
) -> None:
    """No token stands for more characters than the tokenizer's longest piece, so 3 MB of text cannot fit a
    4096-token context: a 400 saying so comes without tokenizing it (the count is a floor: "at least")."""
    huge = "ab " * 1_000_000
    r = post(server, "chat", {"messages": [{"role": "user", "content": huge}]})
    assert r.status_code == 400 and "context overflow: the prompt has at least" in error_message("chat", r), r.text
    legacy = httpx.post(f"{server.url}/v1/completions", json={"prompt": huge, "max_tokens": 2}, timeout=60)
    assert legacy.status_code == 400 and "at least" in legacy.json()["error"]["message"], legacy.text
    r = post(server, "messages", {"messages": MSGS, "system": huge, "max_tokens": 2})
    assert r.status_code == 400 and "at least" in error_message("messages", r), r.text
    over = httpx.post(
        f"{small_body_server.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "ab " * 1000}], "max_tokens": 2},
        timeout=30,
    )
    message = over.json()["error"]["message"]
    assert over.status_code == 400 and "at least" in message and "limit of 100 prompt tokens" in message, over.text
    fits = post(server, "chat", {"messages": [{"role": "user", "content": "ab " * 300}], "max_tokens": 2})
    assert fits.status_code == 200, fits.text


@pytest.mark.slow
def test_a_long_prompt_being_tokenized_does_not_stall_other_streams(policy_dir: Path) -> None:
    """Rendering a 1.7 MB conversation takes seconds (this engine's context, 131072 tokens, might hold it); the
    other requests' tokens keep flowing meanwhile."""
    from clawpipe.serving.server import start_server

    async def run(url: str) -> tuple[float, float]:
        arrivals: list[float] = []
        window: list[float] = []
        async with httpx.AsyncClient(timeout=120) as c:

            async def stream() -> None:
                body = {"messages": MSGS, "max_tokens": 4000, "ignore_eos": True, "stream": True}
                async with c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            arrivals.append(time.monotonic())
                        if len(window) == 2:
                            return

            async def long_prompt() -> None:
                while len(arrivals) < 5:
                    await asyncio.sleep(0.01)
                window.append(time.monotonic())
                body = {"messages": [{"role": "user", "content": "ab " * 566_000}]}
                r = await c.post(f"{url}/v1/chat/completions", json=body)
                window.append(time.monotonic())
                message = r.json()["error"]["message"]
                assert r.status_code == 400 and "context overflow: the prompt has" in message, r.text
                assert "at least" not in message  # it was tokenized

            await asyncio.gather(stream(), long_prompt())
        start, end = window
        during = [start, *(t for t in arrivals if start < t < end), end]
        return end - start, max(b - a for a, b in itertools.pairwise(during))

    handle = start_server(policy_dir, device="cpu", max_prompt_tokens=131071)
    try:
        took, longest_gap = asyncio.run(run(handle.url))
    finally:
        handle.stop()
    assert took > 0.5, f"the long prompt took only {took:.2f}s: too short to show a stall"
    assert longest_gap < took / 2, f"streams stalled {longest_gap:.2f}s of the {took:.2f}s the long prompt took"


@pytest.mark.slow
def test_a_reload_cut_by_shutdown_is_a_503_and_a_second_reload_meanwhile_a_409(policy_dir: Path) -> None:
    """A reload waits for the running batch; a second one meanwhile is told a reload is in progress (409), and
    stopping the server before the swap answers the first with a 503 (not swapped: retry elsewhere), not a 400
    saying the request was wrong."""
    import threading

    from clawpipe.serving.server import start_server

    handle = start_server(
        policy_dir, device="cpu", admin_token="adm", max_model_len=4096, reload_roots=[str(policy_dir)]
    )
    auth = {"Authorization": "Bearer adm"}
    answers: dict[str, httpx.Response] = {}

    def call(name: str, path: str, body: dict[str, Any]) -> None:
        try:
            answers[name] = httpx.post(f"{handle.url}{path}", json=body, headers=auth, timeout=60)
        except httpx.HTTPError:
            pass  # the long request may be cut by the shutdown

    long = {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
    threads = [threading.Thread(target=call, args=("long", "/v1/completions", long))]
    threads[0].start()
    try:
        deadline = time.monotonic() + 30
        while not httpx.get(f"{handle.url}/health").json()["running"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for name in ("a", "b"):
            threads.append(threading.Thread(target=call, args=(name, "/admin/reload", {"path": str(policy_dir)})))
            threads[-1].start()
        while not ({"a", "b"} & answers.keys()):  # one has its weights waiting; the other was turned away
            assert time.monotonic() < deadline + 30
            time.sleep(0.02)
    finally:
        handle.stop()
        for t in threads:
            t.join(30)
    turned_away, cut = sorted((answers["a"], answers["b"]), key=lambda r: r.status_code != 409)
    assert turned_away.status_code == 409 and "already in progress" in turned_away.json()["error"]["message"]
    assert cut.status_code == 503 and "shutting down" in cut.json()["error"]["message"], cut.text


NEST = [{"role": "user", "content": "Nest!"}]
NEST_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def nesting_server(policy_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The tiny policy imprinted to answer NEST with '<tool_call>' and '[' over and over (a degenerate policy)."""
    from clawpipe.serving.policy import TOOL_CALL_OPEN, imprint_policy, load_tokenizer
    from clawpipe.serving.server import start_server

    tok = load_tokenizer(policy_dir)
    prompt = tok.apply_chat_template(
        NEST, tools=NEST_TOOLS, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    completion = tok.encode(TOOL_CALL_OPEN + "[" * 64, add_special_tokens=False)
    nest = imprint_policy(policy_dir, tmp_path_factory.mktemp("policy") / "nest", [(prompt, completion)])
    handle = start_server(nest, device="cpu", served_name="tiny", max_model_len=4096)
    yield handle
    handle.stop()


@pytest.mark.slow
def test_generated_tool_call_json_nested_past_the_parser_stays_text(nesting_server: Any) -> None:
    """'<tool_call>[[[[...' over 1,200 tokens nests deeper than Python's json recurses: the reply is that text
    (finish length), not a 500 or a cut stream."""
    body = {"messages": NEST, "tools": NEST_TOOLS, "max_tokens": 1200, "temperature": 0}
    r = post(nesting_server, "chat", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"].startswith("<tool_call>" + "[" * 1000) and choice["finish_reason"] == "length"
    assert "tool_calls" not in choice["message"]
    events = stream_events(post(nesting_server, "chat", {**body, "stream": True}).text)
    streamed = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert streamed == choice["message"]["content"] and events[-1]["choices"][0]["finish_reason"] == "length"
    anthropic_tools = [{"name": "f", "input_schema": {"type": "object"}}]
    r = post(
        nesting_server, "messages", {"messages": NEST, "tools": anthropic_tools, "max_tokens": 1200, "temperature": 0}
    )
    assert r.status_code == 200 and r.json()["stop_reason"] == "max_tokens", r.text


def test_a_body_or_an_arguments_string_nested_too_deep_is_a_400(server: Any) -> None:
    deep = '{"a":' * 150 + "1" + "}" * 150
    raw = (
        '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "metadata": ' + deep + "}"
    )
    r = httpx.post(f"{server.url}/v1/chat/completions", content=raw.encode(), timeout=30)
    assert r.status_code == 400 and "nests deeper than 100 levels" in error_message("chat", r), r.text
    tools = '[{"name": "f", "input_schema": ' + deep + "}]"
    raw = '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "tools": ' + tools + "}"
    r = httpx.post(f"{server.url}/v1/messages", content=raw.encode(), timeout=30)
    assert r.status_code == 400 and "nests deeper than 100 levels" in error_message("messages", r), r.text
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 3000 + "]" * 3000}}
    body = {"messages": [*MSGS, {"role": "assistant", "content": None, "tool_calls": [call]}], "max_tokens": 2}
    r = post(server, "chat", body)
    assert r.status_code == 400 and "nests too deeply to parse" in error_message("chat", r), r.text
    item = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 3000 + "]" * 3000}
    r = post(server, "responses", {"input": [item], "max_output_tokens": 2})
    assert r.status_code == 400 and "nests too deeply to parse" in error_message("responses", r), r.text
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}}}
    fits = post(
        server,
        "chat",
        {
            "messages": MSGS,
            "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
        },
    )
    assert fits.status_code == 200, fits.text


def test_a_checkpoint_with_nan_weights_is_refused_and_serving_goes_on(policy_dir: Path, tmp_path: Path) -> None:
    """A diverged training step publishes NaN weights; loaded, every response would carry NaN logprobs."""
    import torch

    from clawpipe.serving.policy import load_model, load_tokenizer
    from clawpipe.serving.server import start_server

    model = load_model(policy_dir, "cpu")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    diverged = tmp_path / "diverged"
    model.save_pretrained(diverged)
    load_tokenizer(policy_dir).save_pretrained(diverged)
    handle = start_server(policy_dir, device="cpu", admin_token="adm", max_model_len=4096, reload_roots=[str(tmp_path)])
    try:
        r = httpx.post(
            f"{handle.url}/admin/reload",
            json={"path": str(diverged), "policy_version": 7},
            headers={"Authorization": "Bearer adm"},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        assert "non-finite weights (NaN or inf) in model.layers.0.mlp.up_proj.weight" in r.json()["error"]["message"]
        after = httpx.post(  # ignore_eos: end-of-turn drawn early would end the answer before 3 tokens
            f"{handle.url}/v1/chat/completions",
            json={"messages": MSGS, "max_tokens": 3, "logprobs": True, "ignore_eos": True},
            timeout=60,
        )
        body = strict(after.text)
        assert after.status_code == 200 and body["policy_version"] == 0
        assert len(body["choices"][0]["logprobs"]["content"]) == 3
    finally:
        handle.stop()


def test_stored_responses_stay_within_their_byte_budget(policy_dir: Path) -> None:
    """Items the template never renders (a reasoning item's encrypted content) are kept for
    previous_response_id all the same; the store holds at most its byte budget (1 MB here), oldest out first,
    and an entry larger than the whole budget is not kept."""
    from clawpipe.serving.server import start_server

    handle = start_server(policy_dir, device="cpu", max_model_len=4096, responses_kept_mb=1)

    def respond(blob: int, previous: str | None = None) -> httpx.Response:
        items = [
            {"type": "reasoning", "encrypted_content": "x" * blob, "summary": []},
            {"role": "user", "content": "hi"},
        ]
        body = {"input": items, "max_output_tokens": 2, "previous_response_id": previous}
        return httpx.post(f"{handle.url}/v1/responses", json=body, timeout=60)

    try:
        ids = [respond(400_000).json()["id"] for _ in range(3)]
        first = respond(10, ids[0])
        assert first.status_code == 400 and first.json()["error"]["code"] == "previous_response_not_found"
        assert "up to 1 MB" in first.json()["error"]["message"]
        assert respond(10, ids[2]).status_code == 200  # the latest two fit
        huge = respond(1_200_000)
        assert huge.status_code == 200
        later = respond(10, huge.json()["id"])
        assert later.status_code == 400 and later.json()["error"]["code"] == "previous_response_not_found"
    finally:
        handle.stop()


def test_streams_whose_clients_hang_up_free_their_rows_in_every_api(policy_dir: Path) -> None:
    """Twenty streams over the four APIs, cut at once after their first events: their rows leave the batch and
    the engine serves the next request."""
    import socket

    from clawpipe.serving.server import start_server

    handle = start_server(policy_dir, device="cpu", max_model_len=4096)
    port = int(handle.url.rsplit(":", 1)[1])
    long = {"ignore_eos": True, "stream": True, "temperature": 0}
    bodies = [
        ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 3000, **long}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 3000, **long}),
        ("/v1/messages", {"messages": MSGS, "max_tokens": 3000, **long}),
        ("/v1/completions", {"prompt": ["hi", "yo"], "max_tokens": 3000, **long}),
    ]

    def open_stream(path: str, body: dict[str, Any]) -> socket.socket:
        data = json.dumps(body).encode()
        sock = socket.create_connection(("127.0.0.1", port))
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        sock.sendall(head.encode() + b"\r\n" + data)
        got = b""
        while got.count(b"\n\n") < 2:  # the headers and the first events: admitted and generating
            got += sock.recv(65536)
        return sock

    try:
        socks = [open_stream(path, body) for _ in range(5) for path, body in bodies]
        assert httpx.get(f"{handle.url}/health").json()["running"] > 0
        for sock in socks:
            sock.close()
        deadline = time.monotonic() + 30
        while (health := httpx.get(f"{handle.url}/health").json())["running"] or health["waiting"]:
            assert time.monotonic() < deadline, health
            time.sleep(0.05)
        assert health["stats"]["tokens"] < 25 * 3000 // 2  # nobody's rows ran on to max_tokens
        after = httpx.post(  # ignore_eos: end-of-turn drawn first would end the answer early
            f"{handle.url}/v1/chat/completions",
            json={"messages": MSGS, "max_tokens": 3, "ignore_eos": True},
            timeout=30,
        )
        assert after.status_code == 200 and len(after.json()["choices"][0]["token_ids"]) == 3
    finally:
        handle.stop()
