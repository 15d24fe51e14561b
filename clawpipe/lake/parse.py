"""Parse one captured response (any API, streamed or not) into the columns of ``model_calls``.

Shapes (CONTRACTS.md A): chat and completions (OpenAI, vLLM ``return_token_ids``), responses (OpenAI
Responses) and messages (Anthropic), each plain JSON or SSE. Streams are reassembled into the object the
non-streamed call would have returned, which is what the ``response`` column stores.

Values are normalised so that the same completion gives the same columns whatever the API:
``finish_reason`` uses the OpenAI words (stop, length, tool_calls, content_filter, error) and
``tool_calls`` is a JSON list in the OpenAI chat shape ``[{"id", "type": "function", "function":
{"name", "arguments": str}}]``.

A response that cannot be understood raises :class:`ParseError`; the lander turns it into a reject row.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import orjson

_MESSAGES_STOP = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
_RESPONSES_INCOMPLETE = {"max_output_tokens": "length", "content_filter": "content_filter"}


class ParseError(ValueError):
    """The response does not have the shape its API promises."""


@dataclass(slots=True)
class Choice:
    index: int
    token_ids: list[int] | None = None
    # vLLM's /v1/completions puts each prompt's ids in its choices (and stream chunks' choices), not at the
    # top level; a choice's own prompt ids win over the response's
    prompt_token_ids: Any = None
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


@dataclass(slots=True)
class ParsedCall:
    response: bytes | None = None  # JSON as UTF-8 bytes (raw body, or the reassembled stream)
    prompt_token_ids: list[int] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None  # call total from usage
    spliced_tokens: int | None = None  # prompt ids the engine carried over from the rollout's earlier completions
    policy_version: int | None = None
    model: str | None = None
    error: str | None = None
    choices: list[Choice] = field(default_factory=list)
    # id and logprob lists came from the typed decoder: their element types are checked already
    typed: bool = field(default=False, compare=False)
    # the stream ended in an error (its last event is the API's error event, or a failed response)
    stream_error: bool = False


# --------------------------------------------------------------------------------------------------
# helpers shared by every API


def _logprob_values(lp: Any) -> list[float] | None:
    """Logprob floats from the chat shape ``{"content": [{"logprob"}...]}`` or completions' ``token_logprobs``."""
    if not lp:
        return None
    content = lp.get("content")
    if content is not None:
        return [e["logprob"] for e in content]
    tl = lp.get("token_logprobs")
    if tl is not None:
        return list(tl)
    return None


def _read_top_fields(obj: dict[str, Any], parsed: ParsedCall) -> None:
    """The top-level fields every API's response carries (CONTRACTS A): prompt ids, policy version, model."""
    parsed.prompt_token_ids = obj.get("prompt_token_ids")
    parsed.policy_version = obj.get("policy_version")
    parsed.spliced_tokens = obj.get("spliced_tokens")
    parsed.model = obj.get("model")


def _only_choice(obj: dict[str, Any], finish: str | None, tools: list[dict[str, Any]]) -> Choice:
    """The one choice of a Messages or Responses body (these APIs have no ``n``): ids and logprobs at top level."""
    return Choice(
        index=0,
        token_ids=obj.get("token_ids"),
        logprobs=_logprob_values(obj.get("logprobs")),
        finish_reason=finish,
        tool_calls=tools or None,
    )


def _error_text(err: Any) -> str:
    if isinstance(err, dict):
        msg = err.get("message") or err.get("type") or err.get("code")
        return str(msg) if msg is not None else orjson.dumps(err).decode()
    return str(err)


def _chat_tool_calls(msg: dict[str, Any]) -> list[dict[str, Any]] | None:
    tcs = msg.get("tool_calls")
    if not tcs:
        return None
    return [
        {
            "id": tc.get("id"),
            "type": tc.get("type") or "function",
            "function": {
                "name": (tc.get("function") or {}).get("name"),
                "arguments": (tc.get("function") or {}).get("arguments") or "",
            },
        }
        for tc in tcs
    ]


def _usage_openai(parsed: ParsedCall, usage: Any) -> None:
    if usage:
        parsed.prompt_tokens = usage.get("prompt_tokens")
        parsed.completion_tokens = usage.get("completion_tokens")


def _usage_anthropic(parsed: ParsedCall, usage: Any) -> None:
    if usage:
        inp = usage.get("input_tokens")
        if inp is not None:
            inp += (usage.get("cache_read_input_tokens") or 0) + (usage.get("cache_creation_input_tokens") or 0)
            parsed.prompt_tokens = inp
        if usage.get("output_tokens") is not None:
            parsed.completion_tokens = usage.get("output_tokens")


def iter_sse(body: bytes) -> list[bytes]:
    """The ``data:`` payloads of an SSE body (multi-line data joined by newlines), in order."""
    out: list[bytes] = []
    pending: list[bytes] = []
    for line in body.split(b"\n"):
        if line.startswith(b"data:"):
            pending.append(line[5:].strip())
        elif not line.strip() and pending:
            out.append(pending[0] if len(pending) == 1 else b"\n".join(pending))
            pending = []
    if pending:
        out.append(pending[0] if len(pending) == 1 else b"\n".join(pending))
    return out


def _sse_events(body: bytes) -> list[dict[str, Any]]:
    """Decoded SSE events; a torn last event (stream cut mid-write) is dropped, a bad middle one raises."""
    datas = iter_sse(body)
    events = []
    last = len(datas) - 1
    for i, data in enumerate(datas):
        if data == b"[DONE]":
            continue
        try:
            ev = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            if i == last:
                break
            raise ParseError(f"bad SSE event #{i}: {exc}") from exc
        if isinstance(ev, dict):
            events.append(ev)
    return events


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


# --------------------------------------------------------------------------------------------------
# chat completions and completions


def _openai_choice(c: dict[str, Any], api: str) -> Choice:
    msg = c.get("message") or {}
    return Choice(
        index=c.get("index", 0),
        token_ids=c.get("token_ids"),
        prompt_token_ids=c.get("prompt_token_ids"),
        logprobs=_logprob_values(c.get("logprobs")),
        finish_reason=c.get("finish_reason"),
        tool_calls=_chat_tool_calls(msg) if api == "chat" else None,
    )


def parse_openai(obj: dict[str, Any], api: str, parsed: ParsedCall) -> None:
    if "error" in obj and not obj.get("choices"):
        parsed.error = _error_text(obj["error"])
        return
    _read_top_fields(obj, parsed)
    _usage_openai(parsed, obj.get("usage"))
    parsed.choices = [_openai_choice(c, api) for c in obj.get("choices") or ()]


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
    choices = []
    for idx in sorted(states):
        st = states[idx]
        choice: dict[str, Any] = {"index": idx}
        if api == "chat":
            msg: dict[str, Any] = {"role": st["role"] or "assistant", "content": "".join(st["text"]) or None}
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
        if st["prompt"] is not None:
            choice["prompt_token_ids"] = st["prompt"]
        if st["ids"] is not None:
            choice["token_ids"] = st["ids"]
        if st["lp"] is not None:
            choice["logprobs"] = st["lp"]
        choices.append(choice)
    out["choices"] = choices
    return out


# Typed fast path for plain chat/completions bodies (the bulk of every lake): msgspec decodes only the
# fields below and skips the rest (logprob entries' token strings, bytes, top_logprobs) without building
# Python objects for them: ~40% less time than a generic parse. Anything unexpected falls back.


class _LogprobEntry(msgspec.Struct):
    logprob: float


class _Logprobs(msgspec.Struct):
    content: list[_LogprobEntry] | None = None
    token_logprobs: list[float] | None = None


class _Message(msgspec.Struct):
    tool_calls: list[dict[str, Any]] | None = None


class _OpenAIChoice(msgspec.Struct):
    index: int = 0
    finish_reason: str | None = None
    message: _Message | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | msgspec.UnsetType | None = msgspec.UNSET
    logprobs: _Logprobs | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _OpenAIBody(msgspec.Struct):
    choices: list[_OpenAIChoice] | msgspec.UnsetType = msgspec.UNSET
    prompt_token_ids: list[int] | msgspec.UnsetType | None = msgspec.UNSET
    policy_version: int | None = None
    spliced_tokens: int | None = None
    model: str | None = None
    usage: _Usage | None = None
    error: Any = None
    object: str | None = None


_OPENAI_DECODER = msgspec.json.Decoder(_OpenAIBody)


def _parse_openai_fast(body: bytes, api: str) -> ParsedCall | None:
    """Columns of a plain chat/completions body, or None where the generic parser must decide."""
    cut = _cut_prompt_ids(body) if len(body) > _CUT_MIN_BYTES else None
    try:
        r = _OPENAI_DECODER.decode(cut[0] if cut is not None else body)
    except msgspec.DecodeError:  # includes ValidationError: a shape outside the fast path
        return None
    if r.error is not None or r.object == "error" or r.choices is msgspec.UNSET:
        return None
    prompt: Any = r.prompt_token_ids
    cut_choice = None
    if cut is not None:
        if prompt is None:
            prompt = cut[1]
        else:  # the cut key was in a choice (vLLM completions, one prompt): the one choice left with null ids
            nulled = [c for c in r.choices if c.prompt_token_ids is None]
            if prompt is not msgspec.UNSET or len(nulled) != 1:
                return None
            cut_choice, prompt = nulled[0], None
    elif prompt is msgspec.UNSET:
        prompt = None
    parsed = ParsedCall(
        response=body, prompt_token_ids=prompt, policy_version=r.policy_version, model=r.model, typed=True
    )
    parsed.spliced_tokens = r.spliced_tokens
    if r.usage is not None:
        parsed.prompt_tokens, parsed.completion_tokens = r.usage.prompt_tokens, r.usage.completion_tokens
    choices = []
    for c in r.choices:
        lp = c.logprobs
        values = None
        if lp is not None:
            values = [e.logprob for e in lp.content] if lp.content is not None else lp.token_logprobs
        tools = c.message.tool_calls if api == "chat" and c.message is not None else None
        own_prompt: Any = c.prompt_token_ids
        if c is cut_choice and cut is not None:
            own_prompt = cut[1]
        elif own_prompt is msgspec.UNSET:
            own_prompt = None
        choices.append(
            Choice(
                index=c.index,
                token_ids=c.token_ids,
                prompt_token_ids=own_prompt,
                logprobs=values,
                finish_reason=c.finish_reason,
                tool_calls=_chat_tool_calls({"tool_calls": tools}) if tools else None,
            )
        )
    parsed.choices = choices
    return parsed


# --------------------------------------------------------------------------------------------------
# Anthropic messages


def parse_messages(obj: dict[str, Any], parsed: ParsedCall) -> None:
    if obj.get("type") == "error" or ("error" in obj and "content" not in obj):
        parsed.error = _error_text(obj.get("error"))
        return
    _read_top_fields(obj, parsed)
    _usage_anthropic(parsed, obj.get("usage"))
    tools = [
        {
            "id": b.get("id"),
            "type": "function",
            "function": {"name": b.get("name"), "arguments": _dumps(b.get("input") or {})},
        }
        for b in obj.get("content") or ()
        if b.get("type") == "tool_use"
    ]
    stop = obj.get("stop_reason")
    finish = _MESSAGES_STOP.get(stop, stop) if isinstance(stop, str) else None
    parsed.choices = [_only_choice(obj, finish, tools)]


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
                block["signature"] = d.get("signature")
        elif t == "message_delta":
            d = ev.get("delta") or {}
            for key in ("stop_reason", "stop_sequence"):
                if key in d:
                    msg[key] = d[key]
            if ev.get("usage"):
                msg["usage"] = {**(msg.get("usage") or {}), **ev["usage"]}
            for key in ("token_ids", "logprobs", "policy_version"):
                if key in ev:
                    msg[key] = ev[key]
        elif t == "error":
            msg["type"] = "error"
            msg["error"] = ev.get("error")
    for idx in sorted(blocks):
        block = blocks[idx]
        if block.get("type") == "tool_use" and parts.get(idx):
            text = "".join(parts[idx])
            try:
                block["input"] = orjson.loads(text) if text else {}
            except orjson.JSONDecodeError:
                block["input"] = {"_unparsed": text}
        msg["content"].append(block)
    return msg


# --------------------------------------------------------------------------------------------------
# OpenAI responses


def parse_responses(obj: dict[str, Any], parsed: ParsedCall) -> None:
    if "error" in obj and obj.get("error") and obj.get("status") in (None, "failed"):
        parsed.error = _error_text(obj["error"])
        if "output" not in obj:
            return
    _read_top_fields(obj, parsed)
    _usage_anthropic(parsed, obj.get("usage"))
    tools = [
        {
            "id": item.get("call_id") or item.get("id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments") or ""},
        }
        for item in obj.get("output") or ()
        if item.get("type") == "function_call"
    ]
    status = obj.get("status")
    finish: str | None
    if status == "completed":
        finish = "tool_calls" if tools else "stop"
    elif status == "incomplete":
        reason = str((obj.get("incomplete_details") or {}).get("reason") or "incomplete")
        finish = _RESPONSES_INCOMPLETE.get(reason, reason)
    elif status == "failed":
        finish = "error"
    else:
        finish = status
    parsed.choices = [_only_choice(obj, finish, tools)]


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
        elif t == "response.output_item.done":
            items[ev.get("output_index", len(items))] = ev.get("item")
        elif t == "error":
            error = {k: v for k, v in ev.items() if k != "type"}
    if final is not None:
        if "policy_version" not in final and "policy_version" in created:
            final = {**final, "policy_version": created["policy_version"]}
        return final
    # cut short: what arrived, marked incomplete
    out = {**created, "output": [items[i] for i in sorted(items)], "status": "incomplete"}
    out["incomplete_details"] = {"reason": "stream ended early"}
    if error is not None:
        out["status"] = "failed"
        out["error"] = error
    return out


# --------------------------------------------------------------------------------------------------
# streams cut by an error


def _ends_in_error(api: str, last: dict[str, Any]) -> bool:
    """Whether a stream's last event is its API's error event: the engine (or vLLM) failed part-way, e.g.
    at shutdown, after a 200 head. Chat/completions: ``{"error": ...}`` without choices (vLLM also
    ``{"object": "error"}``); Messages: ``type: error``; Responses: ``error`` or ``response.failed``."""
    if api in ("chat", "completions"):
        return ("error" in last and not last.get("choices")) or last.get("object") == "error"
    if api == "messages":
        return last.get("type") == "error"
    if api == "responses":
        return last.get("type") in ("error", "response.failed")
    return False


def _stream_error_text(last: dict[str, Any]) -> str:
    if last.get("type") == "response.failed":
        err = (last.get("response") or {}).get("error")
        return _error_text(err) if err else "response.failed"
    if "error" in last:
        return _error_text(last["error"])
    return _error_text(last)  # vLLM's {"object": "error", "message"} and the Responses error event


# --------------------------------------------------------------------------------------------------
# entry point

_CUT_MIN_BYTES = 32 << 10
_PROMPT_KEY = b'"prompt_token_ids"'
_NUMERIC = b"0123456789, -\n\r\t"


def _cut_prompt_ids(body: bytes) -> tuple[bytes, np.ndarray] | None:
    """Large bodies: parse the prompt id array with NumPy and hand orjson the rest (``null`` in its place).

    Parsing 16k ids into Python ints and back is most of a large call's landing cost. Used only when the
    key occurs once and the array is plain integers; the caller checks the key was the top-level one.
    """
    i = body.find(_PROMPT_KEY)
    if i < 0 or body.find(_PROMPT_KEY, i + 1) >= 0:
        return None
    j = i + len(_PROMPT_KEY)
    while j < len(body) and body[j] in b" :\t\r\n":
        j += 1
    if j >= len(body) or body[j] != ord("["):
        return None
    k = body.find(b"]", j)
    if k < 0:
        return None
    inner = body[j + 1 : k]
    if inner.translate(None, _NUMERIC) or not inner.strip():
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a malformed list warns and stops early: caught by the count below
        try:
            ids = np.fromstring(inner, dtype=np.int64, sep=",")
        except ValueError:
            return None
    if len(ids) != inner.count(b",") + 1:
        return None
    return body[:j] + b"null" + body[k + 1 :], ids


def parse_response(api: str, stream: bool, body: bytes, *, http_status: int | None = None) -> ParsedCall:
    """Columns of one call from its API, stream flag and raw response body."""
    parsed = ParsedCall()
    if not body:
        return parsed
    failed_http = http_status is not None and http_status >= 400
    if stream and not (failed_http and body[:1] == b"{"):
        events = _sse_events(body)
        if not events:
            if failed_http:
                parsed.error = body[:2000].decode("utf-8", "replace")
                return parsed
            raise ParseError("stream has no decodable SSE events")
        if api in ("chat", "completions"):
            obj = reassemble_openai_stream(events, api)
        elif api == "messages":
            obj = reassemble_messages_stream(events)
        elif api == "responses":
            obj = reassemble_responses_stream(events)
        else:
            raise ParseError(f"streamed {api!r} calls are not a known shape")
        parsed.response = orjson.dumps(obj)
        parsed.stream_error = _ends_in_error(api, events[-1])
    else:
        if api in ("chat", "completions") and not failed_http:
            fast = _parse_openai_fast(body, api)
            if fast is not None:
                return fast
        try:
            cut = _cut_prompt_ids(body) if len(body) > _CUT_MIN_BYTES else None
            if cut is not None:
                obj = orjson.loads(cut[0])
                if not isinstance(obj, dict) or "prompt_token_ids" not in obj or obj["prompt_token_ids"] is not None:
                    obj = orjson.loads(body)  # the key we cut was not the top-level one: take the slow road
                else:
                    obj["prompt_token_ids"] = cut[1]
            else:
                obj = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            if failed_http:
                parsed.error = body[:2000].decode("utf-8", "replace")
                return parsed
            raise ParseError(f"response is not JSON: {exc}") from exc
        parsed.response = body
    if not isinstance(obj, dict):
        raise ParseError(f"response JSON is a {type(obj).__name__}, not an object")
    try:
        if api in ("chat", "completions"):
            parse_openai(obj, api, parsed)
        elif api == "messages":
            parse_messages(obj, parsed)
        elif api == "responses":
            parse_responses(obj, parsed)
        elif "error" in obj:
            parsed.error = _error_text(obj["error"])
    except (AttributeError, KeyError, TypeError) as exc:
        raise ParseError(f"unexpected {api} response shape: {type(exc).__name__}: {exc}") from exc
    if parsed.stream_error and parsed.error is None:
        parsed.error = _stream_error_text(events[-1])
    if parsed.error is None and (failed_http or obj.get("object") == "error"):
        # vLLM: {"object": "error", "message"}; FastAPI: {"detail"}; anything else: the body itself
        detail = obj.get("error") or obj.get("message") or obj.get("detail")
        parsed.error = _error_text(detail) if detail is not None else _dumps(obj)[:2000]
    return parsed
