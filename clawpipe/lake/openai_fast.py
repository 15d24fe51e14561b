"""The fast paths for plain chat and completions bodies (the bulk of every lake), and the large-body
prompt-id cut the generic parser uses.

First the compiled reader (``clawpipe/lake/_openai_scan.c``, built by the install): one pass over the
body, ids and logprobs straight into ``array.array`` buffers, no Python number per token. Where it is not
built, or steps aside (any shape outside the plain one), msgspec decodes only the fields landing keeps and
skips the rest (message text, logprob entries' text, bytes and top_logprobs) without building Python
objects for them; in a large body the prompt id array is read by NumPy and cut out before the JSON is
decoded (:func:`cut_prompt_ids`). Anything neither expects returns None and :mod:`clawpipe.lake.parse`
decides. Both give the same columns (tests/lake/test_openai_scan.py).
"""

from __future__ import annotations

import warnings
from typing import Any

import msgspec
import numpy as np
import orjson

from clawpipe.lake.parsed import Choice, ParsedCall, chat_tool_calls, drop_echoed_prompts

try:
    from clawpipe.lake import _openai_scan
except ImportError:  # installed where no C compiler was: msgspec reads every body
    _openai_scan = None  # type: ignore[assignment]

CUT_MIN_BYTES = 32 << 10
_PROMPT_KEY = b'"prompt_token_ids"'
_DIGITS = b"0123456789,-"
_JSON_SPACE = b" \n\r\t"


def cut_prompt_ids(body: bytes) -> tuple[bytes, np.ndarray] | None:
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
    compact = inner
    spaces = inner.translate(None, _DIGITS)  # one pass; empty for compact JSON (what servers write)
    if spaces:
        if spaces.translate(None, _JSON_SPACE):
            return None  # not plain integers
        compact = inner.translate(None, _JSON_SPACE)
        if b",," in compact:
            return None  # an empty place ("1, ,2"): NumPy would read a 0
    if not compact or compact[:1] == b"," or compact[-1:] == b",":
        return None  # an empty place at either end: NumPy would pass over it
    with warnings.catch_warnings():
        # a malformed list (a number cut short, two in a row) warns where it stops reading: an error here,
        # which spares counting the commas of every list to find out
        warnings.simplefilter("error")
        try:
            ids = np.fromstring(inner, dtype=np.int64, sep=",")  # "1 2" stops it: spaces only around commas
        except (ValueError, DeprecationWarning):
            return None
    return body[:j] + b"null" + body[k + 1 :], ids


# The typed decoder: only the fields below, the rest skipped without building Python objects for them
# (~40% less time than a generic parse). Anything unexpected falls back.


class _LogprobEntry(msgspec.Struct, gc=False):
    logprob: float


class _Logprobs(msgspec.Struct, gc=False):
    content: list[_LogprobEntry] | None = None
    token_logprobs: list[float] | None = None


class _Message(msgspec.Struct, gc=False):
    tool_calls: list[dict[str, Any]] | None = None


class _OpenAIChoice(msgspec.Struct, gc=False):
    index: int = 0
    finish_reason: str | None = None
    message: _Message | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | msgspec.UnsetType | None = msgspec.UNSET
    logprobs: _Logprobs | None = None


class _Usage(msgspec.Struct, gc=False):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _OpenAIBody(msgspec.Struct, gc=False):
    choices: list[_OpenAIChoice] | msgspec.UnsetType = msgspec.UNSET
    prompt_token_ids: list[int] | msgspec.UnsetType | None = msgspec.UNSET
    policy_version: int | None = None
    spliced_tokens: int | None = None
    model: str | None = None
    usage: _Usage | None = None
    error: Any = None
    object: str | None = None


_OPENAI_DECODER = msgspec.json.Decoder(_OpenAIBody)


def parse_openai_fast(body: bytes | memoryview, api: str) -> ParsedCall | None:
    """Columns of a plain chat/completions body, or None where the generic parser must decide."""
    if _openai_scan is not None:
        got = _openai_scan.scan(body)
        if got is not None:
            parsed = _from_scan(got, body, api)
            if parsed is not None:
                return parsed
    return parse_openai_msgspec(bytes(body), api)


def _from_scan(got: tuple[Any, ...], body: bytes | memoryview, api: str) -> ParsedCall | None:
    """The compiled reader's answer as a :class:`ParsedCall` (None: tool calls that are not plain JSON)."""
    prompt, version, spliced, model, prompt_tokens, completion_tokens, raw = got
    parsed = ParsedCall(response=body, prompt_token_ids=prompt, policy_version=version, model=model, typed=True)
    parsed.spliced_tokens, parsed.prompt_tokens, parsed.completion_tokens = spliced, prompt_tokens, completion_tokens
    choices = []
    for index, finish, tools_json, ids, own_prompt, lps in raw:
        tools = None
        if tools_json is not None and api == "chat":
            try:
                tools = orjson.loads(tools_json)  # a list of objects, checked by the reader
            except orjson.JSONDecodeError:  # what orjson alone refuses (an integer past 64 bits)
                return None
        choices.append(
            Choice(
                index=index,
                token_ids=ids,
                prompt_token_ids=own_prompt,
                logprobs=lps,
                finish_reason=finish,
                tool_calls=chat_tool_calls({"tool_calls": tools}) if tools else None,
            )
        )
    if api == "completions":
        drop_echoed_prompts(choices, prompt, prompt_tokens, completion_tokens)
    parsed.choices = choices
    return parsed


def parse_openai_msgspec(body: bytes, api: str) -> ParsedCall | None:
    """:func:`parse_openai_fast` by msgspec alone (where the compiled reader is not built, or steps aside)."""
    cut = cut_prompt_ids(body) if len(body) > CUT_MIN_BYTES else None
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
                tool_calls=chat_tool_calls({"tool_calls": tools}) if tools else None,
            )
        )
    if api == "completions":  # echo: the prompt's logprobs come first (when a server sends no null for its first)
        drop_echoed_prompts(choices, prompt, parsed.prompt_tokens, parsed.completion_tokens)
    parsed.choices = choices
    return parsed
