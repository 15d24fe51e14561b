"""Stop strings that span token boundaries, in every API, streamed and not: the text ends before the stop
string, and the token ids and logprobs reported with it decode to exactly that text."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from clawpipe.serving.policy import load_tokenizer
from tests.serving.calls import stream_events
from tests.serving.conftest import FINAL_TEXT, SECOND_TURN, TOOLS, USER

GREEDY = {"model": "tiny", "messages": SECOND_TURN, "tools": TOOLS, "temperature": 0, "max_tokens": 24}
# the same conversation as the Messages API spells it
ANTHROPIC = {
    "model": "tiny",
    "temperature": 0,
    "max_tokens": 24,
    "tools": [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ],
    "messages": [
        {"role": "user", "content": USER},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_c", "name": "guess", "input": {"number": 42}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_c", "content": "correct"}]},
    ],
}


@pytest.fixture(scope="module")
def reply(server: Any, scripted_dir: Any) -> dict[str, Any]:
    """The greedy answer to SECOND_TURN without stop strings, with the span of each token's text."""
    body = httpx.post(f"{server.url}/v1/chat/completions", json={**GREEDY, "logprobs": True}, timeout=60).json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == FINAL_TEXT, body
    tok = load_tokenizer(scripted_dir)
    ids = choice["token_ids"]
    pieces = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
    return {"ids": ids, "logprobs": [e["logprob"] for e in choice["logprobs"]["content"]], "ends": pieces}


def straddling(reply: dict[str, Any]) -> tuple[str, int]:
    """A stop string made of the last character of token j and the first of token j + 1 (its first place in
    the text), and j: the ids before token j are the ones whose text ends before it."""
    ends = [len(p) for p in reply["ends"]]
    for j in range(1, len(ends) - 2):
        start, end = ends[j - 1], ends[j]
        if end - start >= 2:
            stop = FINAL_TEXT[end - 1 : end + 1]
            if FINAL_TEXT.find(stop) == end - 1 and FINAL_TEXT[start:end].strip():
                return stop, j
    raise AssertionError(f"no token of {FINAL_TEXT!r} has two characters before another token")


def test_a_chat_stop_string_across_tokens_returns_whole_tokens_before_it(server: Any, reply: dict[str, Any]) -> None:
    stop, j = straddling(reply)
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**GREEDY, "stop": [stop], "logprobs": True}, timeout=60)
    choice = r.json()["choices"][0]
    text = choice["message"]["content"]
    assert stop not in text and FINAL_TEXT.startswith(text) and choice["finish_reason"] == "stop", choice
    assert choice["stop_reason"] == stop
    assert choice["token_ids"] == reply["ids"][:j]  # the token carrying the stop string's start is left out
    assert text == reply["ends"][j - 1]  # ... and the text is exactly what those ids decode to
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(reply["logprobs"][:j])
    assert r.json()["usage"]["completion_tokens"] == j


def test_a_streamed_chat_stop_string_across_tokens_never_sends_its_tokens(server: Any, reply: dict[str, Any]) -> None:
    stop, j = straddling(reply)
    body = {**GREEDY, "stop": stop, "stream": True, "logprobs": True, "stream_options": {"include_usage": True}}
    events = stream_events(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).text)
    ids: list[int] = []
    lps: list[float] = []
    text = ""
    for ev in events:
        for ch in ev["choices"]:
            assert ch["index"] == 0
            ids += ch.get("token_ids") or []
            lps += [e["logprob"] for e in ((ch.get("logprobs") or {}).get("content") or [])]
            text += ch["delta"].get("content") or ""
        # a chunk carries each choice at most once
        assert len({ch["index"] for ch in ev["choices"]}) == len(ev["choices"])
    assert ids == reply["ids"][:j] and text == reply["ends"][j - 1] and lps == pytest.approx(reply["logprobs"][:j])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == j
    assert all(ev["choices"] for ev in events[:-1])  # a step whose ids are all held back sends no chunk


@pytest.mark.parametrize("stream", [False, True])
def test_an_anthropic_stop_sequence_across_tokens_returns_whole_tokens_before_it(
    server: Any, reply: dict[str, Any], stream: bool
) -> None:
    stop, j = straddling(reply)
    body = {**ANTHROPIC, "stop_sequences": [stop], "stream": stream}
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
    if stream:
        events = stream_events(r.text)
        text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
        end = next(e for e in events if e["type"] == "message_delta")
        got = {"ids": end["token_ids"], "reason": end["delta"]["stop_reason"], "seq": end["delta"]["stop_sequence"]}
    else:
        msg = r.json()
        text = "".join(b["text"] for b in msg["content"] if b["type"] == "text")
        got = {"ids": msg["token_ids"], "reason": msg["stop_reason"], "seq": msg["stop_sequence"]}
    assert got == {"ids": reply["ids"][:j], "reason": "stop_sequence", "seq": stop}
    assert text == reply["ends"][j - 1] and stop not in text


def test_n_choices_with_a_stop_string_stream_what_they_return_whole(server: Any, scripted_dir: Any) -> None:
    """n sampled choices, each cut by a stop string at its own place: streamed chunks carry each choice at most
    once, and per choice the streamed ids and text equal the non-streamed ones, the ids decoding to the text."""
    tok = load_tokenizer(scripted_dir)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "n": 4, "seed": 3}
    free = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()["choices"]
    stop = [c["message"]["content"][3:5] for c in free if len(c["message"]["content"]) > 6][:2]
    assert stop, free
    whole = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stop": stop}, timeout=60).json()
    streamed = stream_events(
        httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stop": stop, "stream": True}, timeout=60).text
    )
    ids: dict[int, list[int]] = {i: [] for i in range(4)}
    texts = dict.fromkeys(range(4), "")
    for ev in streamed:
        assert len({ch["index"] for ch in ev["choices"]}) == len(ev["choices"])
        for ch in ev["choices"]:
            ids[ch["index"]] += ch.get("token_ids") or []
            texts[ch["index"]] += ch["delta"].get("content") or ""
    assert any(c["finish_reason"] == "stop" and c["stop_reason"] in stop for c in whole["choices"])
    for c in whole["choices"]:
        i = c["index"]
        assert (ids[i], texts[i]) == (c["token_ids"], c["message"]["content"])
        if c["stop_reason"] in stop:  # cut by a stop string: no end-of-turn id, the ids are the text
            assert tok.decode(c["token_ids"]) == c["message"]["content"]
        assert not any(s in c["message"]["content"] for s in stop)
