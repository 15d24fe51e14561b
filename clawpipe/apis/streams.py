"""Streamed responses reassembled into the body the same call returns unstreamed, one function per API.

Input is the decoded JSON events of one stream in order (``[DONE]`` left out). Every field a chunk carries
that the unstreamed body also carries is kept, including the engine's and vLLM's token ids, logprobs,
``prompt_token_ids``, ``spliced_tokens`` and ``policy_version``. A stream cut short gives what arrived:
Responses marks it ``incomplete`` (or ``failed`` after an error event), Messages keeps the blocks so far.
"""

from __future__ import annotations

from typing import Any

import orjson

# the top-level fields of a chat/completions stream's chunks, each taken from the first chunk that has it
_STREAM_TOP_KEYS = (
    "id",
    "created",
    "model",
    "prompt_token_ids",
    "spliced_tokens",
    "policy_version",
    "system_fingerprint",
)


def whole_text(text: str) -> str:
    """``text`` with each surrogate pair that arrived as two halves (a server holding UTF-16 strings cut a
    delta between them) joined into its character; a half left alone becomes U+FFFD."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return text


def whole_characters(value: Any) -> Any:
    """:func:`whole_text` applied to every string in a JSON value (keys included)."""
    if isinstance(value, str):
        return whole_text(value)
    if isinstance(value, list):
        return [whole_characters(v) for v in value]
    if isinstance(value, dict):
        return {whole_text(k): whole_characters(v) for k, v in value.items()}
    return value


# vLLM's reasoning parsers put the model's thinking in its own field of a chat message and its deltas:
# ``reasoning_content`` in older releases, ``reasoning`` in newer ones (some servers send both).
_REASONING_KEYS = ("reasoning_content", "reasoning")
# the one key of a streamed tool input whose JSON was cut short (max_tokens mid-call): the text received
UNPARSED_INPUT = "_unparsed"


def reassemble_openai_stream(events: list[dict[str, Any]], api: str) -> dict[str, Any]:
    """The non-streamed response equivalent to chat.completion.chunk / completions chunks."""
    out: dict[str, Any] = {"object": "chat.completion" if api == "chat" else "text_completion"}
    states: dict[int, dict[str, Any]] = {}
    for ev in events:
        if "error" in ev and not ev.get("choices"):
            out["error"] = ev["error"]
            continue
        for key in _STREAM_TOP_KEYS:
            if ev.get(key) is not None and key not in out:  # vLLM sends "prompt_token_ids": null after the first
                out[key] = ev[key]
        if ev.get("usage"):
            out["usage"] = ev["usage"]
        for c in ev.get("choices") or ():
            idx = c.get("index", 0)
            st = states.get(idx)
            if st is None:
                st = states[idx] = {
                    "text": [],
                    "refusal": [],
                    "reasoning": {},  # field name -> parts: vLLM's reasoning parsers stream it beside content
                    "role": None,
                    "tools": {},
                    "ids": None,
                    "lp": None,
                    "fr": None,
                    "prompt": None,
                }
            if c.get("prompt_token_ids") is not None and st["prompt"] is None:
                st["prompt"] = c["prompt_token_ids"]
            if api == "chat":
                delta = c.get("delta") or {}
                if delta.get("role"):
                    st["role"] = delta["role"]
                if delta.get("content"):
                    st["text"].append(delta["content"])
                if delta.get("refusal"):  # a refusal streams in its own deltas, never in content
                    st["refusal"].append(delta["refusal"])
                for key in _REASONING_KEYS:  # the thinking a reasoning parser splits off, under either name
                    if isinstance(delta.get(key), str) and delta[key]:
                        st["reasoning"].setdefault(key, []).append(delta[key])
                for tc in delta.get("tool_calls") or ():
                    t = st["tools"].setdefault(tc.get("index", 0), {"id": None, "type": "function", "n": [], "a": []})
                    if tc.get("id"):
                        t["id"] = tc["id"]
                    fn = tc.get("function") or {}
                    if fn.get("name"):
                        t["n"].append(fn["name"])
                    if fn.get("arguments"):
                        t["a"].append(fn["arguments"])
            elif c.get("text"):
                st["text"].append(c["text"])
            if c.get("token_ids") is not None:
                if st["ids"] is None:
                    st["ids"] = []
                st["ids"].extend(c["token_ids"])
            lp = c.get("logprobs")
            if lp:
                cur = st["lp"]
                if cur is None:
                    cur = st["lp"] = {"content": []} if "content" in lp else {"token_logprobs": [], "tokens": []}
                if "content" in lp and "content" in cur:
                    cur["content"].extend(lp["content"] or ())
                elif "token_logprobs" in cur:
                    cur["token_logprobs"].extend(lp.get("token_logprobs") or ())
                    cur["tokens"].extend(lp.get("tokens") or ())
            if c.get("finish_reason") is not None:
                st["fr"] = c["finish_reason"]
            if c.get("stop_reason") is not None:  # vLLM: the stop string or token id that ended the choice
                st["stop"] = c["stop_reason"]
    choices = []
    for idx in sorted(states):
        st = states[idx]
        choice: dict[str, Any] = {"index": idx}
        if api == "chat":
            msg: dict[str, Any] = {"role": st["role"] or "assistant", "content": "".join(st["text"]) or None}
            if st["refusal"]:
                msg["refusal"] = "".join(st["refusal"])
            for key, parts in st["reasoning"].items():
                msg[key] = "".join(parts)
            if st["tools"]:
                msg["tool_calls"] = [
                    {
                        "id": t["id"],
                        "type": t["type"],
                        "function": {"name": "".join(t["n"]), "arguments": "".join(t["a"])},
                    }
                    for _, t in sorted(st["tools"].items())
                ]
            choice["message"] = msg
        else:
            choice["text"] = "".join(st["text"])
        choice["finish_reason"] = st["fr"]
        if st.get("stop") is not None:
            choice["stop_reason"] = st["stop"]
        if st["prompt"] is not None:
            choice["prompt_token_ids"] = st["prompt"]
        if st["ids"] is not None:
            choice["token_ids"] = st["ids"]
        if st["lp"] is not None:
            choice["logprobs"] = st["lp"]
        choices.append(choice)
    out["choices"] = choices
    return out


def reassemble_messages_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    msg: dict[str, Any] = {"type": "message", "role": "assistant", "content": []}
    blocks: dict[int, dict[str, Any]] = {}
    parts: dict[int, list[str]] = {}
    for ev in events:
        t = ev.get("type")
        if t == "message_start":
            start = dict(ev.get("message") or {})
            start.pop("content", None)
            msg.update(start)
        elif t == "content_block_start":
            idx = ev.get("index", len(blocks))
            blocks[idx] = dict(ev.get("content_block") or {})
            parts[idx] = []
        elif t == "content_block_delta":
            idx = ev.get("index", 0)
            d = ev.get("delta") or {}
            block = blocks.setdefault(idx, {"type": "text", "text": ""})
            dt = d.get("type")
            if dt == "text_delta":
                block["text"] = block.get("text", "") + d.get("text", "")
            elif dt == "input_json_delta":
                parts.setdefault(idx, []).append(d.get("partial_json", ""))
            elif dt == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + d.get("thinking", "")
            elif dt == "signature_delta":
                # one delta in practice; joined all the same, as the text deltas are
                block["signature"] = (block.get("signature") or "") + (d.get("signature") or "")
            elif dt == "citations_delta":
                # a text block's citations arrive one per delta; the block starts with none (or null)
                block["citations"] = [*(block.get("citations") or ()), d.get("citation")]
        elif t == "message_delta":
            d = ev.get("delta") or {}
            for key in ("stop_reason", "stop_sequence"):
                if key in d:
                    msg[key] = d[key]
            if ev.get("usage"):
                # the final counts; a count it leaves null keeps message_start's (input tokens are known there)
                late = {k: v for k, v in ev["usage"].items() if v is not None}
                msg["usage"] = {**(msg.get("usage") or {}), **late}
            for key in ("token_ids", "logprobs", "policy_version"):
                if key in ev:
                    msg[key] = ev[key]
        elif t == "error":
            msg["type"] = "error"
            msg["error"] = ev.get("error")
    for idx in sorted(blocks):
        block = blocks[idx]
        # tool_use, server_tool_use (a search the server runs), mcp_tool_use: each streams its input as JSON
        if parts.get(idx) and ("input" in block or str(block.get("type")).endswith("tool_use")):
            text = whole_text("".join(parts[idx]))
            try:
                block["input"] = orjson.loads(text) if text else {}
            except orjson.JSONDecodeError:
                block["input"] = {UNPARSED_INPUT: text}
        msg["content"].append(block)
    return msg


def _responses_item(items: dict[int, Any], ev: dict[str, Any]) -> dict[str, Any]:
    """The item an event of a Responses stream adds to (by ``output_index``), made when no event announced it."""
    idx = ev.get("output_index", 0)
    item = items.get(idx)
    if not isinstance(item, dict):
        item = items[idx] = {"type": "function_call" if "arguments" in ev.get("type", "") else "message"}
    return item


def _responses_part(item: dict[str, Any], ev: dict[str, Any], kind: str) -> dict[str, Any]:
    """The content part (by ``content_index``) of a message item that a delta event adds to."""
    parts = item.setdefault("content", [])
    i = ev.get("content_index", 0)
    while len(parts) <= i:
        parts.append({"type": kind, kind.removeprefix("output_"): ""})
    return parts[i]


def _responses_delta(items: dict[int, Any], ev: dict[str, Any]) -> None:
    """Apply one delta event to the item it belongs to, so a stream cut before the item's done event keeps
    what arrived (text, refusal, call arguments, reasoning summary)."""
    t = ev.get("type", "")
    delta = ev.get("delta")
    if not isinstance(delta, str):
        return
    item = _responses_item(items, ev)
    if t == "response.output_text.delta":
        part = _responses_part(item, ev, "output_text")
        part["text"] = part.get("text", "") + delta
    elif t == "response.refusal.delta":
        part = _responses_part(item, ev, "refusal")
        part["refusal"] = part.get("refusal", "") + delta
    elif t == "response.function_call_arguments.delta":
        item["arguments"] = item.get("arguments", "") + delta
    elif t == "response.reasoning_summary_text.delta":
        summary = item.setdefault("summary", [])
        i = ev.get("summary_index", 0)
        while len(summary) <= i:
            summary.append({"type": "summary_text", "text": ""})
        summary[i]["text"] += delta


def reassemble_responses_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    final: dict[str, Any] | None = None
    created: dict[str, Any] = {}
    items: dict[int, Any] = {}
    error = None
    for ev in events:
        t = ev.get("type", "")
        if t in ("response.completed", "response.incomplete", "response.failed"):
            final = ev.get("response") or {}
        elif t in ("response.created", "response.in_progress"):
            created.update(ev.get("response") or {})
        elif t == "response.output_item.added" and isinstance(ev.get("item"), dict):
            items[ev.get("output_index", len(items))] = dict(ev["item"])
        elif t == "response.output_item.done":
            items[ev.get("output_index", len(items))] = ev.get("item")
        elif t.endswith(".delta"):
            _responses_delta(items, ev)
        elif t == "error":
            error = {k: v for k, v in ev.items() if k != "type"}
    if final is not None:
        if "policy_version" not in final and "policy_version" in created:
            final = {**final, "policy_version": created["policy_version"]}
        if final.get("output") == [] and items:  # a failed response may list none of the items it streamed
            final = {**final, "output": [items[i] for i in sorted(items)]}
        return final
    # cut short: what arrived, marked incomplete
    out = {**created, "output": [items[i] for i in sorted(items)], "status": "incomplete"}
    out["incomplete_details"] = {"reason": "stream ended early"}
    if error is not None:
        out["status"] = "failed"
        out["error"] = error
    return out


def reassemble(api: str, events: list[dict[str, Any]]) -> dict[str, Any]:
    """The unstreamed body of ``api`` (chat, completions, messages or responses) that ``events`` spell."""
    if api in ("chat", "completions"):
        return reassemble_openai_stream(events, api)
    if api == "messages":
        return reassemble_messages_stream(events)
    if api == "responses":
        return reassemble_responses_stream(events)
    raise ValueError(f"streamed {api!r} calls are not a known shape; known: chat, completions, messages, responses")
