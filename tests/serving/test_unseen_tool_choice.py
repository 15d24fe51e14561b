"""tool_choice that names what the answer must be: "required" / {"type": "any"} make it begin with a tool call,
a named function or tool with a call of that tool, in every API, streamed and not; the ids forced so are
reported with the policy's own logprobs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from clawpipe.serving.policy import TOOL_CALL_OPEN, load_model, load_tokenizer
from tests.serving.calls import stream_events
from tests.serving.conftest import FINAL_TEXT, SECOND_TURN, TOOLS, USER
from tests.serving.test_unseen_stop import ANTHROPIC

CHAT = {"model": "tiny", "messages": SECOND_TURN, "tools": TOOLS, "temperature": 0, "max_tokens": 40}
NAMED = TOOL_CALL_OPEN + '{"name": "guess", "arguments": '


def forced_ids(scripted_dir: Path, text: str) -> list[int]:
    """The ids of `text` as a whole call beginning with it encodes them (the last, crossing its end, left out)."""
    tok = load_tokenizer(scripted_dir)
    whole = tok.encode(text + '{"number": 1}}</tool_call>', add_special_tokens=False)
    n = max(k for k in range(len(whole) + 1) if text.startswith(tok.decode(whole[:k])))
    assert n > 0
    return list(whole[:n])


def chat(server: Any, **extra: Any) -> dict[str, Any]:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_auto_lets_the_scripted_policy_answer_in_text(server: Any) -> None:
    """The baseline the forced choices below differ from: this conversation is answered without a call."""
    for choice in (None, "auto"):
        body = chat(server, tool_choice=choice)["choices"][0]
        assert body["message"]["content"] == FINAL_TEXT and body["finish_reason"] == "stop"


def test_required_makes_the_chat_answer_begin_with_a_tool_call(server: Any, scripted_dir: Path) -> None:
    body = chat(server, tool_choice="required", logprobs=True)
    choice = body["choices"][0]
    opening = forced_ids(scripted_dir, TOOL_CALL_OPEN)
    assert choice["token_ids"][: len(opening)] == opening, choice
    # the forced id is reported with the policy's own logprob of it after the prompt
    model = load_model(scripted_dir, "cpu")
    with torch.inference_mode():
        logits = model(torch.tensor([body["prompt_token_ids"]])).logits[0, -1].float()
    own = float(torch.log_softmax(logits, -1)[opening[0]])
    assert choice["logprobs"]["content"][0]["logprob"] == pytest.approx(own, abs=1e-4)
    assert own < -1e-3  # not what the policy would have chosen: it was forced


def test_a_named_function_makes_the_chat_answer_a_call_of_that_function(server: Any, scripted_dir: Path) -> None:
    choice = chat(server, tool_choice={"type": "function", "function": {"name": "guess"}})["choices"][0]
    prefix = forced_ids(scripted_dir, NAMED)
    assert choice["token_ids"][: len(prefix)] == prefix
    calls = choice["message"].get("tool_calls") or []
    assert [c["function"]["name"] for c in calls] == ["guess"] or choice["message"]["content"].startswith(NAMED)
    for c in calls:
        assert isinstance(json.loads(c["function"]["arguments"]), dict)


def test_a_streamed_required_answer_begins_with_a_tool_call(server: Any, scripted_dir: Path) -> None:
    r = httpx.post(
        f"{server.url}/v1/chat/completions", json={**CHAT, "tool_choice": "required", "stream": True}, timeout=60
    )
    ids = [t for ev in stream_events(r.text) for ch in ev["choices"] for t in ch.get("token_ids") or []]
    opening = forced_ids(scripted_dir, TOOL_CALL_OPEN)
    assert ids[: len(opening)] == opening


@pytest.mark.parametrize(
    ("choice", "text"), [({"type": "any"}, TOOL_CALL_OPEN), ({"type": "tool", "name": "guess"}, NAMED)]
)
def test_anthropic_any_and_named_tool_choices_force_a_call(
    server: Any, scripted_dir: Path, choice: dict[str, Any], text: str
) -> None:
    r = httpx.post(f"{server.url}/v1/messages", json={**ANTHROPIC, "max_tokens": 40, "tool_choice": choice}, timeout=60)
    assert r.status_code == 200, r.text
    prefix = forced_ids(scripted_dir, text)
    assert r.json()["token_ids"][: len(prefix)] == prefix
    plain = httpx.post(f"{server.url}/v1/messages", json={**ANTHROPIC, "max_tokens": 40}, timeout=60).json()
    assert plain["content"] == [{"type": "text", "text": FINAL_TEXT}]


def test_responses_required_forces_a_call(server: Any, scripted_dir: Path) -> None:
    body = {
        "model": "tiny",
        "input": [
            {"role": "user", "content": USER},
            {"type": "function_call", "call_id": "c", "name": "guess", "arguments": '{"number": 42}'},
            {"type": "function_call_output", "call_id": "c", "output": "correct"},
        ],
        "tools": [{"type": "function", **t["function"]} for t in TOOLS],
        "tool_choice": "required",
        "temperature": 0,
        "max_output_tokens": 30,
    }
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    opening = forced_ids(scripted_dir, TOOL_CALL_OPEN)
    assert r.json()["token_ids"][: len(opening)] == opening
    plain = httpx.post(f"{server.url}/v1/responses", json={**body, "tool_choice": "auto"}, timeout=60).json()
    texts = [part["text"] for item in plain["output"] if item["type"] == "message" for part in item["content"]]
    assert texts == [FINAL_TEXT], plain
