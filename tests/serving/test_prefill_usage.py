"""A prefilled request sampled with a seed: the stream and the plain response give the same ids, and both
count the prefill's ids in the prompt tokens and only the continuation in the completion tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from clawpipe.serving import policy
from tests.serving.calls import post, stream_events

MESSAGES = [{"role": "user", "content": "Answer in JSON."}, {"role": "assistant", "content": '{"answer":'}]


@pytest.fixture(scope="module")
def tok(scripted_dir: Path) -> Any:
    return policy.load_tokenizer(scripted_dir)


def _body(api: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": 10, "temperature": 1.0, "seed": 11, "messages": MESSAGES, "stream": stream}
    if api == "chat":
        body.update(continue_final_message=True, add_generation_prompt=False)
        if stream:
            body["stream_options"] = {"include_usage": True}
    return body


def _plain(api: str, got: dict[str, Any]) -> tuple[list[int], list[int], int, int]:
    """(prompt ids, completion ids, prompt tokens, completion tokens) of a plain response."""
    if api == "messages":
        usage = got["usage"]
        return got["prompt_token_ids"], got["token_ids"], usage["input_tokens"], usage["output_tokens"]
    usage = got["usage"]
    ids = got["choices"][0]["token_ids"]
    return got["prompt_token_ids"], ids, usage["prompt_tokens"], usage["completion_tokens"]


def _streamed(api: str, text: str) -> tuple[list[int], list[int], int, int]:
    events = stream_events(text)
    if api == "messages":
        start = next(e for e in events if e["type"] == "message_start")["message"]
        delta = next(e for e in events if e["type"] == "message_delta")
        usage = delta["usage"]
        return start["prompt_token_ids"], delta["token_ids"], usage["input_tokens"], usage["output_tokens"]
    ids = [t for c in events for ch in c["choices"] for t in ch.get("token_ids", [])]
    usage = next(c["usage"] for c in events if c.get("usage"))
    return events[0]["prompt_token_ids"], ids, usage["prompt_tokens"], usage["completion_tokens"]


@pytest.mark.parametrize("api", ["messages", "chat"])
def test_stream_and_plain_give_the_same_ids_and_usage_for_a_prefill(server: Any, api: str) -> None:
    plain = post(server, api, _body(api, False))
    streamed = post(server, api, _body(api, True))
    assert plain.status_code == 200 and streamed.status_code == 200, (plain.text, streamed.text)
    got = _plain(api, plain.json())
    assert _streamed(api, streamed.text) == got
    prompt, ids, n_prompt, n_completion = got
    assert (n_prompt, n_completion) == (len(prompt), len(ids)) and ids


def test_responses_and_completions_do_not_continue_a_final_assistant_message(server: Any, tok: Any) -> None:
    """The Responses API renders an input ending in an assistant message with a new assistant turn after it
    (vLLM's fields mean nothing there), and a completions prompt ending in the assistant's text is encoded
    as it is, with nothing opened or closed around it."""
    r = post(
        server,
        "responses",
        {"input": MESSAGES, "max_output_tokens": 2, "continue_final_message": True, "add_generation_prompt": False},
    )
    assert r.status_code == 200, r.text
    want = tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert r.json()["prompt_token_ids"] == list(want)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, continue_final_message=True)
    c = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": text, "max_tokens": 2}, timeout=60)
    assert c.status_code == 200, c.text
    assert c.json()["prompt_token_ids"] == list(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("api", ["messages", "chat"])
def test_a_huge_prefill_is_refused_before_it_is_tokenized(server: Any, api: str) -> None:
    """A prefill far over the context is the usual 400, decided from its length alone (tokenizing it would
    cost ~80 bytes per character first)."""
    huge = [MESSAGES[0], {"role": "assistant", "content": "word " * 400_000 + "x"}]
    body: dict[str, Any] = {"max_tokens": 4, "messages": huge}
    if api == "chat":
        body.update(continue_final_message=True, add_generation_prompt=False)
    r = post(server, api, body)
    assert r.status_code == 400, r.text
    assert "context overflow: the prompt has at least" in r.text and "shorten the conversation" in r.text
