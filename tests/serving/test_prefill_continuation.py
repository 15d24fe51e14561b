"""A request ending in the assistant's own text is continued, not closed: Anthropic's prefill and vLLM's
continue_final_message / add_generation_prompt, against the real engine and the tiny policy (prompt ids, the
greedy continuation computed directly with the model, streams, the splice across turns, and the 400s)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from clawpipe.serving import policy
from clawpipe.serving.splice import ROLLOUT_HEADER, TurnMemory, render_open, render_spliced
from tests.serving.calls import error_message, post, stream_events
from tests.serving.test_splice import QWEN_LIKE

USER = [{"role": "user", "content": "Answer in JSON."}]
PREFILL = '{"answer":'
MAX = 12


@pytest.fixture(scope="module")
def tok(scripted_dir: Path) -> Any:
    return policy.load_tokenizer(scripted_dir)


@pytest.fixture(scope="module")
def model(scripted_dir: Path) -> Any:
    return policy.load_model(scripted_dir, "cpu")


def _stops(tok: Any) -> set[int]:
    return {tok.convert_tokens_to_ids(policy.IM_END), tok.convert_tokens_to_ids(policy.ENDOFTEXT)}


def _opened(tok: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The ids of `messages` followed by the template's generation prompt (a new assistant turn)."""
    return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))


def _encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


@torch.no_grad()
def _greedy(model: Any, prompt: list[int], n: int, stops: set[int]) -> list[int]:
    """What the model produces greedily from `prompt`, one full forward per token (no KV cache, no engine)."""
    ids, out = list(prompt), []
    for _ in range(n):
        t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(t)
        ids.append(t)
        if t in stops:
            break
    return out


def _visible(tok: Any, ids: list[int]) -> str:
    return str(tok.decode([t for t in ids if t not in _stops(tok)], skip_special_tokens=False))


def _messages_body(prefill: Any, **extra: Any) -> dict[str, Any]:
    return {
        "max_tokens": MAX,
        "temperature": 0,
        "messages": [*USER, {"role": "assistant", "content": prefill}],
        **extra,
    }


# ---------------------------------------------------------------- Anthropic Messages: prefill


@pytest.mark.parametrize("shape", ["string", "text blocks"])
def test_messages_prefill_is_continued_greedily_from_the_open_turn(
    server: Any, tok: Any, model: Any, shape: str
) -> None:
    """The prompt ends with the prefill's ids (no end-of-turn, no new assistant header after them), the
    completion is what the model greedily produces from exactly those ids, and the content holds only it."""
    prefill: Any = (
        PREFILL if shape == "string" else [{"type": "text", "text": '{"ans'}, {"type": "text", "text": 'wer":'}]
    )
    r = post(server, "messages", _messages_body(prefill))
    assert r.status_code == 200, r.text
    body = r.json()
    head = _opened(tok, USER)
    assert body["prompt_token_ids"] == head + _encode(tok, PREFILL)
    assert tok.convert_tokens_to_ids(policy.IM_END) not in body["prompt_token_ids"][len(head) :]
    assert body["token_ids"] == _greedy(model, body["prompt_token_ids"], MAX, _stops(tok))
    assert body["content"][0]["text"] == _visible(tok, body["token_ids"])
    assert body["usage"]["input_tokens"] == len(head) + len(_encode(tok, PREFILL))


def test_messages_prefill_streams_the_same_continuation(server: Any, tok: Any, model: Any) -> None:
    r = post(server, "messages", _messages_body(PREFILL, stream=True))
    assert r.status_code == 200, r.text
    events = stream_events(r.text)
    start = next(e for e in events if e["type"] == "message_start")["message"]
    delta = next(e for e in events if e["type"] == "message_delta")
    prompt = _opened(tok, USER) + _encode(tok, PREFILL)
    assert start["prompt_token_ids"] == prompt
    assert delta["token_ids"] == _greedy(model, prompt, MAX, _stops(tok))
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == _visible(tok, delta["token_ids"])


def test_messages_empty_prefill_opens_the_turn_once(server: Any, tok: Any) -> None:
    """An empty final assistant message (allowed by the Messages API) is an open turn with nothing in it: the
    prompt is the generation prompt, not an empty closed turn followed by a second header."""
    r = post(server, "messages", _messages_body(""))
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == _opened(tok, USER)


def test_messages_count_tokens_counts_the_open_turn(server: Any, tok: Any) -> None:
    r = httpx.post(
        f"{server.url}/v1/messages/count_tokens",
        json={"model": "tiny", "messages": [*USER, {"role": "assistant", "content": PREFILL}]},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["input_tokens"] == len(_opened(tok, USER)) + len(_encode(tok, PREFILL))


@pytest.mark.parametrize(
    "prefill",
    ['{"answer": ', "{\n", [{"type": "text", "text": "{"}, {"type": "text", "text": " \t"}], " "],
    ids=["space", "newline", "blocks", "only-space"],
)
def test_messages_prefill_ending_in_whitespace_is_a_400(server: Any, prefill: Any) -> None:
    r = post(server, "messages", _messages_body(prefill))
    assert r.status_code == 400, r.text
    message = error_message("messages", r)
    assert "messages[1]" in message and "cannot end with trailing whitespace" in message


def test_messages_final_tool_use_is_a_400_naming_the_block(server: Any) -> None:
    prefill = [
        {"type": "text", "text": "Let me guess."},
        {"type": "tool_use", "id": "toolu_1", "name": "guess", "input": {"number": 1}},
    ]
    r = post(server, "messages", _messages_body(prefill))
    assert r.status_code == 400, r.text
    message = error_message("messages", r)
    assert "messages[1].content[1]" in message and "tool_result" in message


# ---------------------------------------------------------------- OpenAI chat: vLLM's extra fields


def _chat_body(**extra: Any) -> dict[str, Any]:
    return {
        "max_tokens": MAX,
        "temperature": 0,
        "messages": [*USER, {"role": "assistant", "content": PREFILL}],
        **extra,
    }


@pytest.mark.parametrize("stream", [False, True])
def test_chat_continue_final_message_continues_greedily(server: Any, tok: Any, model: Any, stream: bool) -> None:
    r = post(server, "chat", _chat_body(continue_final_message=True, add_generation_prompt=False, stream=stream))
    assert r.status_code == 200, r.text
    prompt = _opened(tok, USER) + _encode(tok, PREFILL)
    if stream:
        chunks = stream_events(r.text)
        assert chunks[0]["prompt_token_ids"] == prompt
        ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
        text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    else:
        body = r.json()
        assert body["prompt_token_ids"] == prompt
        ids = body["choices"][0]["token_ids"]
        text = body["choices"][0]["message"]["content"]
    assert ids == _greedy(model, prompt, MAX, _stops(tok))
    assert text == _visible(tok, ids)


def test_chat_without_generation_prompt_renders_the_messages_as_they_are(server: Any, tok: Any) -> None:
    """add_generation_prompt false alone: the final turn stays closed and no new header follows; by default
    (vLLM's too) a final assistant message is closed and a new assistant turn starts."""
    messages = [*USER, {"role": "assistant", "content": PREFILL}]
    closed = post(server, "chat", _chat_body(add_generation_prompt=False))
    assert closed.status_code == 200, closed.text
    want = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=False, return_dict=False)
    assert closed.json()["prompt_token_ids"] == list(want)
    default = post(server, "chat", _chat_body())
    assert default.json()["prompt_token_ids"] == _opened(tok, messages)


@pytest.mark.parametrize(
    ("extra", "param", "wants"),
    [
        ({"continue_final_message": True}, "continue_final_message", ["add_generation_prompt", "false"]),
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message", ["both"]),
        ({"continue_final_message": "true", "add_generation_prompt": False}, "continue_final_message", ["true or"]),
        ({"add_generation_prompt": 0}, "add_generation_prompt", ["true or false"]),
    ],
    ids=["default-generation-prompt", "both-true", "continue-string", "generation-int"],
)
def test_chat_flag_misuse_is_a_400_naming_the_field(
    server: Any, extra: dict[str, Any], param: str, wants: list[str]
) -> None:
    r = post(server, "chat", _chat_body(**extra))
    assert r.status_code == 400, r.text
    message = error_message("chat", r)
    assert f"'{param}'" in message and all(w in message for w in wants), message
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("final", ["user", "tool calls"])
def test_chat_continue_needs_a_final_assistant_text(server: Any, final: str) -> None:
    messages: list[dict[str, Any]] = list(USER)
    if final == "tool calls":
        call = {"id": "call_1", "type": "function", "function": {"name": "guess", "arguments": "{}"}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    body = {"max_tokens": 4, "messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    r = post(server, "chat", body)
    assert r.status_code == 400, r.text
    message = error_message("chat", r)
    assert "continue_final_message" in message
    assert ("'user'" in message) if final == "user" else ("tool_calls" in message)


# ---------------------------------------------------------------- token fidelity across turns (splice)


def _rollout_post(server: Any, api: str, body: dict[str, Any], rollout: str) -> dict[str, Any]:
    path = {"chat": "/v1/chat/completions", "messages": "/v1/messages"}[api]
    r = httpx.post(server.url + path, json={"model": "tiny", **body}, headers={ROLLOUT_HEADER: rollout}, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_continuing_a_cut_off_answer_carries_its_sampled_ids(server: Any, tok: Any, model: Any) -> None:
    """A rollout's answer cut by max_tokens, sent back as the final assistant message to continue: the prompt is
    the first prompt plus the ids the model sampled (not their re-encoding), and two greedy halves make one
    greedy whole."""
    rollout = f"r-{uuid.uuid4().hex}"
    first = _rollout_post(server, "chat", {"max_tokens": 5, "temperature": 0, "messages": USER}, rollout)
    part = first["choices"][0]
    assert part["finish_reason"] == "length"
    body = {
        "max_tokens": MAX,
        "temperature": 0,
        "messages": [*USER, {"role": "assistant", "content": part["message"]["content"]}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    second = _rollout_post(server, "chat", body, rollout)
    assert second["prompt_token_ids"] == first["prompt_token_ids"] + part["token_ids"]
    assert second["spliced_tokens"] == len(part["token_ids"])
    whole = _greedy(model, first["prompt_token_ids"], 5 + MAX, _stops(tok))
    assert part["token_ids"] + second["choices"][0]["token_ids"] == whole


def test_a_prefilled_turn_sent_back_whole_carries_prefill_and_sampled_ids(server: Any, tok: Any) -> None:
    """The client sends the prefill and its continuation back as one assistant turn: the next prompt extends the
    prefilled prompt and its completion exactly."""
    rollout = f"r-{uuid.uuid4().hex}"
    first = _rollout_post(server, "messages", _messages_body(PREFILL), rollout)
    turn = PREFILL + first["content"][0]["text"]
    follow = {
        "max_tokens": 4,
        "temperature": 0,
        "messages": [*USER, {"role": "assistant", "content": turn}, {"role": "user", "content": "Thanks."}],
    }
    second = _rollout_post(server, "messages", follow, rollout)
    before = first["prompt_token_ids"] + first["token_ids"]
    assert second["prompt_token_ids"][: len(before)] == before
    assert second["spliced_tokens"] == len(_encode(tok, PREFILL)) + len(first["token_ids"])


@pytest.mark.parametrize("how", ["cut by max_tokens", "ended its turn", "cut at a stop string"])
def test_a_completion_repeated_as_prefill_is_spliced_only_when_its_ids_spell_it(tok: Any, how: str) -> None:
    """A rollout's completion sent back as the text to continue carries its sampled ids only when they spell
    exactly that text: ids ending with the end-of-turn token would close the turn, and ids cut at a stop string
    hold the stop string the client never saw; those are encoded from the text instead."""
    eos = tok.convert_tokens_to_ids(policy.IM_END)
    sampled = [i for ch in "ok sure" for i in _encode(tok, ch)]  # non-canonical, as an untrained policy samples
    if how == "ended its turn":
        sampled.append(eos)
    if how == "cut at a stop string":
        sampled += _encode(tok, " END")
    memory = TurnMemory()
    memory.remember("r", "ok sure", [], sampled)
    messages = [*USER, {"role": "assistant", "content": "ok sure"}]
    found = memory.find("r", messages)
    assert found == {1: sampled}
    got = render_open(tok, messages, None, found, {eos}, "continue")
    assert got is not None
    body = sampled if how == "cut by max_tokens" else _encode(tok, "ok sure")
    assert list(got) == _opened(tok, USER) + body
    assert (got.spliced, got.spliced_turns) == ((len(sampled), 1) if how == "cut by max_tokens" else (0, 0))
    assert got.prefill_ids == len(body)
    assert render_spliced(tok, messages, None, found, {eos}, "continue") == (list(got), got.spliced)


@pytest.mark.parametrize("template", ["tiny", "qwen-like"])
@pytest.mark.parametrize("prefill", ["", "{"])
def test_open_turn_ends_with_the_prefill_under_both_templates(tok: Any, template: str, prefill: str) -> None:
    """The open final turn is the generation prompt followed by the prefill's own ids, also under a template
    that renders an empty assistant body without its newline (Qwen's)."""
    if template == "qwen-like":
        tok = type(tok).from_pretrained(tok.name_or_path)
        tok.chat_template = QWEN_LIKE
    got = render_open(tok, [*USER, {"role": "assistant", "content": prefill}], None, {}, set(), "continue")
    assert got is not None
    assert list(got) == _opened(tok, USER) + _encode(tok, prefill)
    assert (got.prefill, got.prefill_ids) == (prefill, len(_encode(tok, prefill)))
