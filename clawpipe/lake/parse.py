"""Parse one captured response (any API, streamed or not) into the columns of ``model_calls``.

Shapes (docs/ARCHITECTURE.md, contract A): chat and completions (OpenAI, vLLM ``return_token_ids``), responses (OpenAI
Responses) and messages (Anthropic), each plain JSON or SSE. Streams are reassembled into the object the
non-streamed call would have returned, which is what the ``response`` column stores.

Values are normalised so that the same completion gives the same columns whatever the API:
``finish_reason`` uses the OpenAI words (stop, length, tool_calls, content_filter, error; a reason they have no
word for, such as Anthropic's ``pause_turn``, is kept as sent) and
``tool_calls`` is a JSON list in the OpenAI chat shape ``[{"id", "type": "function", "function":
{"name", "arguments": str}}]``.

Plain chat and completions bodies take a typed fast path first (:mod:`clawpipe.lake.openai_fast`); what
parsing gives is :class:`ParsedCall` (:mod:`clawpipe.lake.parsed`). A response that cannot be understood
raises :class:`ParseError`; the lander turns it into a reject row.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from clawpipe.apis.sse import read_events
from clawpipe.apis.streams import UNPARSED_INPUT, reassemble, whole_characters
from clawpipe.lake.openai_fast import CUT_MIN_BYTES, cut_prompt_ids, parse_openai_fast
from clawpipe.lake.parsed import Choice, ParsedCall, ParseError, chat_tool_calls, drop_echoed_prompts

__all__ = ["Choice", "ParseError", "ParsedCall", "parse_messages", "parse_openai", "parse_response", "parse_responses"]

_MESSAGES_STOP = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",  # cut by the context window rather than max_tokens
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
_RESPONSES_INCOMPLETE = {"max_output_tokens": "length", "content_filter": "content_filter"}


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
    """The top-level fields every API's response carries (docs/ARCHITECTURE.md, contract A): prompt ids, policy
    version, model."""
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


def _lone_surrogates(data: bytes) -> Any:
    """An event whose JSON holds a lone surrogate escape (a UTF-16 server cut a delta inside a pair), which
    orjson refuses: the standard decoder keeps the half, for :func:`whole_characters` to join after
    reassembly. None when the event is bad for another reason."""
    if b"\\ud" not in data.lower():
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


def _sse_events(body: bytes) -> tuple[list[dict[str, Any]], bool]:
    """Decoded SSE events, and whether one held half a surrogate pair; a torn last event (stream cut
    mid-write) is dropped, a bad middle one raises."""
    datas = [ev.data.strip() for ev in read_events(body)]
    events = []
    halves = False
    last = len(datas) - 1
    for i, data in enumerate(datas):
        if data == b"[DONE]":
            continue
        try:
            ev = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            ev = _lone_surrogates(data)
            if ev is None:
                if i == last:
                    break
                raise ParseError(f"bad SSE event #{i}: {exc}") from exc
            halves = True
        if isinstance(ev, dict):
            events.append(ev)
    return events, halves


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
        tool_calls=chat_tool_calls(msg) if api == "chat" else None,
    )


def parse_openai(obj: dict[str, Any], api: str, parsed: ParsedCall) -> None:
    if "error" in obj and not obj.get("choices"):
        parsed.error = _error_text(obj["error"])
        return
    _read_top_fields(obj, parsed)
    _usage_openai(parsed, obj.get("usage"))
    parsed.choices = [_openai_choice(c, api) for c in obj.get("choices") or ()]
    if api == "completions":  # echo: the prompt's logprobs come first
        drop_echoed_prompts(parsed.choices, parsed.prompt_token_ids, parsed.prompt_tokens, parsed.completion_tokens)


# --------------------------------------------------------------------------------------------------
# Anthropic messages


def _tool_input_arguments(block: dict[str, Any], streamed: bool) -> str:
    """A tool_use block's input as the chat shape's ``arguments`` string. A stream cut inside the input (by
    max_tokens, mid-call) leaves JSON text that does not parse, which reassembly wraps as ``{"_unparsed": text}``:
    the arguments are that text, as chat and Responses give the arguments they received so far."""
    inp = block.get("input")
    if streamed and isinstance(inp, dict) and len(inp) == 1 and isinstance(inp.get(UNPARSED_INPUT), str):
        return str(inp[UNPARSED_INPUT])
    return _dumps(inp or {})


def parse_messages(obj: dict[str, Any], parsed: ParsedCall, *, streamed: bool = False) -> None:
    failed = obj.get("type") == "error" or obj.get("error") is not None or ("error" in obj and "content" not in obj)
    if failed:
        parsed.error = _error_text(obj.get("error"))
        if "content" not in obj:  # an error body; a stream cut by an error event keeps what arrived before it
            return
    _read_top_fields(obj, parsed)
    _usage_anthropic(parsed, obj.get("usage"))
    tools = [
        {
            "id": b.get("id"),
            "type": "function",
            "function": {"name": b.get("name"), "arguments": _tool_input_arguments(b, streamed)},
        }
        for b in obj.get("content") or ()
        if b.get("type") == "tool_use"
    ]
    stop = obj.get("stop_reason")
    finish = _MESSAGES_STOP.get(stop, stop) if isinstance(stop, str) else None
    parsed.choices = [_only_choice(obj, "error" if failed else finish, tools)]


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


def parse_response(api: str, stream: bool, body: bytes | memoryview, *, http_status: int | None = None) -> ParsedCall:
    """Columns of one call from its API, stream flag and raw response body (landing hands over a view of the
    capture frame: the fast path reads it in place, the others take a copy)."""
    parsed = ParsedCall()
    if not body:
        return parsed
    failed_http = http_status is not None and http_status >= 400
    if not stream and not failed_http and api in ("chat", "completions"):
        fast = parse_openai_fast(body, api)
        if fast is not None:
            return fast
    body = bytes(body)
    from_stream = stream and not (failed_http and body[:1] == b"{")
    if from_stream:
        events, halves = _sse_events(body)
        if not events:
            if failed_http:
                parsed.error = body[:2000].decode("utf-8", "replace")
                return parsed
            raise ParseError("stream has no decodable SSE events")
        try:
            obj = reassemble(api, events)
        except ValueError as exc:
            raise ParseError(str(exc)) from exc
        if halves:
            obj = whole_characters(obj)
        parsed.response = orjson.dumps(obj)
        parsed.stream_error = _ends_in_error(api, events[-1])
    else:
        try:
            cut = cut_prompt_ids(body) if len(body) > CUT_MIN_BYTES else None
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
            parse_messages(obj, parsed, streamed=from_stream)
        elif api == "responses":
            parse_responses(obj, parsed)
        elif obj.get("error") is not None:  # a stored response read back carries "error": null
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
