"""The model's own ids carried into the next turn: the splice against real tokenizers and chat templates (the
tiny policy's and a Qwen-like one with tool calls), the per-rollout memory's bounds and matching, and the engine
over Chat, Responses and Messages (streamed and not) with the proxy's rollout header."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from clawpipe.serving.splice import ROLLOUT_HEADER, TurnMemory, render_spliced
from clawpipe.serving.text import ToolCall
from tests.serving.conftest import FIRST_TURN, TOOLS

# Qwen2.5's tool-call layout: calls on their own lines after the content, tool results as user turns. Newlines
# right after a block tag are written as expressions: chat templates render with trim_blocks.
NL = "{{ '\\n' }}"
QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\n<tools>{% for t in tools %}" + NL + "{{ t | tojson }}{% endfor %}" + NL + "</tools>\n\n"
    "For each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant{% if m.content %}{{ '\\n' + m.content }}{% endif %}"
    "{% for tc in m.tool_calls or [] %}" + NL + "<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SHELL = [{"type": "function", "function": {"name": "shell", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tokenizer(policy_dir: Path) -> Any:
    from clawpipe.serving.policy import load_tokenizer

    return load_tokenizer(policy_dir)


def _render(tok: Any, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
    return list(
        tok.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False)
    )


def _char_ids(tok: Any, text: str) -> list[int]:
    """A valid but non-canonical encoding of text (one id per character), as an untrained policy samples."""
    return [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]


def _splice(tok: Any, memory: TurnMemory, messages: list[dict[str, Any]], tools: Any = None) -> tuple[list[int], int]:
    found = memory.find("r", messages)
    eos = {tok.convert_tokens_to_ids("<|im_end|>")}
    got = render_spliced(tok, messages, tools, found, eos)
    assert got is not None
    return got


@pytest.mark.parametrize("template", ["tiny", "qwen-like"])
def test_tool_call_turn_carries_the_sampled_ids(tokenizer: Any, template: str) -> None:
    """A turn answered with a tool call comes back as a structured call: the next prompt holds the ids the model
    sampled for it (non-canonical here), then exactly the template's text after the turn, and no re-encoding."""
    tok = tokenizer
    if template == "qwen-like":
        tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
        tok.chat_template = QWEN_LIKE
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List the files."}]
    p1 = _render(tok, first, SHELL)
    sampled = _char_ids(tok, 'Sure.\n<tool_call>\n{"name": "shell", "arguments": {"command": "ls"}}\n</tool_call>')
    sampled.append(eos)
    memory = TurnMemory()
    memory.remember("r", "Sure.", [ToolCall("call_abc", "shell", '{"command": "ls"}')], sampled)
    call = {"id": "call_abc", "type": "function", "function": {"name": "shell", "arguments": '{"command":"ls"}'}}
    second = [
        *first,
        {"role": "assistant", "content": "Sure.", "tool_calls": [call]},
        {"role": "tool", "content": "a.txt"},
    ]
    ids, spliced = _splice(tok, memory, second, SHELL)
    assert spliced == len(sampled)
    assert ids[: len(p1) + len(sampled)] == p1 + sampled
    plain_text = tok.apply_chat_template(second, tools=SHELL, tokenize=False, add_generation_prompt=True)
    after_turn = plain_text[plain_text.index("<|im_end|>", len(tok.decode(p1))) + len("<|im_end|>") :]
    assert tok.decode(ids[len(p1) + len(sampled) :]) == after_turn
    assert after_turn.endswith("<|im_start|>assistant\n") and "a.txt" in after_turn
    plain = _render(tok, second, SHELL)
    assert plain[: len(p1) + len(sampled)] != p1 + sampled  # what re-encoding gives: a context never sampled


def test_text_turns_chain_and_a_changed_turn_is_re_encoded(tokenizer: Any) -> None:
    """Append-only history: each prompt extends the previous prompt + completion. A turn the harness changed is
    re-encoded (a genuine rewrite) while the unchanged ones are still spliced."""
    tok = tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    memory = TurnMemory()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Guess my number."}]
    prev: list[int] = _render(tok, messages)
    replies = ["My guess is 42", "Higher then: 77?"]
    for k, reply in enumerate(replies):
        sampled = [*_char_ids(tok, reply), eos]
        memory.remember("r", reply, [], sampled)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"No ({k})."}]
        ids, spliced = _splice(tok, memory, messages)
        assert ids[: len(prev) + len(sampled)] == prev + sampled
        prev = ids
    assert spliced == sum(len(_char_ids(tok, r)) + 1 for r in replies)
    changed = [dict(m) for m in messages]
    changed[1]["content"] = "My guess is 41"
    ids, spliced = _splice(tok, memory, changed)
    assert spliced == len(_char_ids(tok, replies[1])) + 1
    p0 = _render(tok, changed[:1])
    assert ids[: len(p0)] == p0
    assert ids[len(p0) :].count(tok.convert_tokens_to_ids("<|im_end|>")) >= 2
    assert tok.decode(ids[len(p0) :]).startswith("My guess is 41<|im_end|>")  # re-encoded as the harness sent it


def test_a_reply_cut_by_max_tokens_keeps_the_template_end_of_turn(tokenizer: Any) -> None:
    """Sampled ids without an end-of-turn token (cut by max_tokens): the template's own end follows them."""
    tok = tokenizer
    memory = TurnMemory()
    sampled = _char_ids(tok, "My gue")
    memory.remember("r", "My gue", [], sampled)
    messages = [{"role": "user", "content": "Go."}, {"role": "assistant", "content": "My gue"}]
    ids, _ = _splice(tok, memory, [*messages, {"role": "user", "content": "On."}])
    p1 = _render(tok, messages[:1])
    assert ids[: len(p1) + len(sampled)] == p1 + sampled
    assert tok.decode(ids[len(p1) + len(sampled) :]).startswith("<|im_end|>\n<|im_start|>user\nOn.")


def test_memory_matches_exactly_and_stays_bounded() -> None:
    """Calls match by id across APIs' prefixes (call_X / toolu_X) with the same name and arguments (as values);
    changed arguments, content or another rollout do not match; rollouts are dropped least recently used first,
    and a rollout's oldest completions beyond its token cap."""
    memory = TurnMemory(max_rollouts=2, max_tokens=10)
    memory.remember("a", "", [ToolCall("call_1", "guess", '{"number": 42}')], [1, 2, 3])
    anthropic_call = {"id": "toolu_1", "function": {"name": "guess", "arguments": '{"number":42}'}}
    assert memory.find("a", [{"role": "assistant", "content": "", "tool_calls": [anthropic_call]}]) == {0: [1, 2, 3]}
    changed = {"id": "toolu_1", "function": {"name": "guess", "arguments": '{"number": 43}'}}
    assert memory.find("a", [{"role": "assistant", "content": "", "tool_calls": [changed]}]) == {}
    assert memory.find("a", [{"role": "assistant", "content": "x", "tool_calls": [anthropic_call]}]) == {}
    assert memory.find("b", [{"role": "assistant", "content": "", "tool_calls": [anthropic_call]}]) == {}
    memory.remember("a", "hello", [], [4, 5, 6, 7])
    memory.remember("a", "world", [], [8, 9, 10, 11])  # 11 ids > 10: the oldest completion goes
    said = [{"role": "assistant", "content": t} for t in ("hello", "world")]
    assert memory.find("a", said) == {0: [4, 5, 6, 7], 1: [8, 9, 10, 11]}
    assert memory.find("a", [{"role": "assistant", "content": "", "tool_calls": [anthropic_call]}]) == {}
    memory.remember("b", "x", [], [1])
    memory.find("a", said)  # a used more recently than b
    memory.remember("c", "y", [], [2])  # three rollouts > 2: b goes
    assert memory.find("b", [{"role": "assistant", "content": "x"}]) == {}
    assert memory.find("a", said) and memory.find("c", [{"role": "assistant", "content": "y"}])


# ---------------------------------------------------------------- the engine, over HTTP


@pytest.fixture(scope="module")
def tiny_server(policy_dir: Path) -> Iterator[Any]:
    from clawpipe.serving.server import start_server

    handle = start_server(policy_dir, device="cpu", admin_token="a", max_model_len=2048, served_name="tiny")
    yield handle
    handle.stop()


def _post(url: str, path: str, body: dict[str, Any], rollout: str | None) -> dict[str, Any]:
    headers = {ROLLOUT_HEADER: rollout} if rollout else {}
    if not body.get("stream"):
        r = httpx.post(url + path, json=body, headers=headers, timeout=120)
        r.raise_for_status()
        return dict(r.json())
    from clawpipe.lake.parse import parse_response

    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=120) as r:
        raw = r.read()
    api = {"/v1/chat/completions": "chat", "/v1/messages": "messages", "/v1/responses": "responses"}[path]
    return dict(json.loads(parse_response(api, True, raw).response or b"{}"))


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_chat_loop_prompts_extend_the_sampled_ids(tiny_server: Any, policy_dir: Path, stream: bool) -> None:
    """Three chat turns of one rollout with the untrained tiny policy: every prompt starts with the previous
    prompt + the sampled completion; spliced_tokens counts the carried ids; the next turn's logprobs are the
    model's own under teacher forcing on that prompt (1e-4). Without the header the same history re-encodes."""
    from clawpipe.serving.policy import compute_logprobs, load_model

    rollout = f"run/0/chat-{stream}"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Guess my number."}]
    prev: list[int] = []
    carried = 0
    for turn in range(3):
        body = {"messages": messages, "max_tokens": 12, "seed": turn, "stream": stream, "logprobs": True}
        r = _post(tiny_server.url, "/v1/chat/completions", body, rollout)
        prompt, choice = r["prompt_token_ids"], r["choices"][0]
        assert prompt[: len(prev)] == prev
        assert r["spliced_tokens"] == carried
        prev = prompt + choice["token_ids"]
        carried += len(choice["token_ids"])
        messages += [{"role": "assistant", "content": choice["message"]["content"]}, {"role": "user", "content": "No."}]
    lps = [e["logprob"] for e in choice["logprobs"]["content"]]
    model = load_model(policy_dir, "cpu")
    recomputed = compute_logprobs(model, prompt, choice["token_ids"])
    assert max(abs(a - b) for a, b in zip(lps, recomputed, strict=True)) < 1e-4
    before = httpx.get(tiny_server.url + "/health").json()["splice"]
    plain = _post(tiny_server.url, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}, None)
    assert plain["spliced_tokens"] == 0 and plain["prompt_token_ids"][: len(prev)] != prev
    after = httpx.get(tiny_server.url + "/health").json()["splice"]
    assert after["spliced_tokens"] == before["spliced_tokens"] >= carried - len(choice["token_ids"])


SCRIPTED_BODIES: dict[str, Any] = {
    "/v1/chat/completions": {"messages": FIRST_TURN, "tools": TOOLS, "max_tokens": 40, "temperature": 0},
    "/v1/messages": {
        "messages": FIRST_TURN,
        "tools": [{"name": "guess", "description": "Guess", "input_schema": TOOLS[0]["function"]["parameters"]}],
        "max_tokens": 40,
        "temperature": 0,
    },
    "/v1/responses": {
        "input": FIRST_TURN,
        "tools": [{"type": "function", "name": "guess", "parameters": TOOLS[0]["function"]["parameters"]}],
        "max_output_tokens": 40,
        "temperature": 0,
    },
}


def _follow_up(path: str, first: dict[str, Any], answer: dict[str, Any], arguments: dict[str, Any]) -> dict[str, Any]:
    """The harness's next request: the call sent back as its API shapes it (with `arguments`), then its result."""
    if path == "/v1/chat/completions":
        call = answer["choices"][0]["message"]["tool_calls"][0]
        sent = {**call, "function": {**call["function"], "arguments": json.dumps(arguments)}}
        back = {"role": "assistant", "content": None, "tool_calls": [sent]}
        return {**first, "messages": [*FIRST_TURN, back, {"role": "tool", "tool_call_id": call["id"], "content": "ok"}]}
    if path == "/v1/messages":
        block = next(b for b in answer["content"] if b["type"] == "tool_use")
        back = {"role": "assistant", "content": [{**block, "input": arguments}]}
        result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block["id"], "content": "ok"}]}
        return {**first, "messages": [*FIRST_TURN, back, result]}
    item = next(i for i in answer["output"] if i["type"] == "function_call")
    output = {"type": "function_call_output", "call_id": item["call_id"], "output": "ok"}
    return {**first, "input": [*FIRST_TURN, {**item, "arguments": json.dumps(arguments)}, output]}


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", list(SCRIPTED_BODIES))
def test_tool_calls_are_matched_by_call_id_on_every_api(server: Any, path: str, stream: bool) -> None:
    """The scripted policy answers with a guess(42) call; sent back with its call id and the same arguments,
    the follow-up's prompt carries the call's sampled ids; sent back with other arguments it is re-encoded."""
    first = {**SCRIPTED_BODIES[path], "model": "tiny", "stream": stream}
    rollout = f"run/0/{path}-{stream}"
    answer = _post(server.url, path, first, rollout)
    sampled = answer["choices"][0]["token_ids"] if path == "/v1/chat/completions" else answer["token_ids"]
    same = _post(server.url, path, _follow_up(path, first, answer, {"number": 42}), rollout)
    assert same["spliced_tokens"] == len(sampled) > 0
    assert same["prompt_token_ids"][: len(answer["prompt_token_ids"]) + len(sampled)] == (
        answer["prompt_token_ids"] + sampled
    )
    changed = _post(server.url, path, _follow_up(path, first, answer, {"number": 7}), rollout)
    assert changed["spliced_tokens"] == 0
    elsewhere = _post(server.url, path, _follow_up(path, first, answer, {"number": 42}), "run/0/another")
    assert elsewhere["spliced_tokens"] == 0
