"""Coercion: one captured record (typed header, request and response bytes) -> its ``model_calls`` values,
by column name.

:func:`call_values` parses the response (:mod:`clawpipe.lake.parse`), reconciles it with the header
(policy version, token source, a 200 answer that is an error) and returns the values the call's rows
share plus one mapping per choice, keyed by the column names of :data:`clawpipe.schemas.MODEL_CALLS`.
Every value is checked here or by the header's struct (lists: their element types here, their ranges per
row group in :mod:`clawpipe.lake.columns`); a value that does not fit raises :class:`rows.BadValue` and
the record is a reject. Nothing is appended anywhere until every value is checked, so a reject leaves
no part of its call behind.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import orjson

from clawpipe import capture
from clawpipe.lake import rows
from clawpipe.lake.parse import ParsedCall, parse_response

log = logging.getLogger(__name__)

_NULL = b"null"


class CallValues(NamedTuple):
    call: dict[str, Any]  # the values every row (choice) of the call shares
    choices: list[dict[str, Any]]  # one mapping per row
    policy_version_mismatch: bool  # the engine reported another policy_version than the proxy's stamp
    stream_error: bool  # a 200 answer that is an error: now upstream_error


def call_values(
    header: capture.CaptureHeader, request: bytes | memoryview, response: bytes | memoryview, seg: str, off: int
) -> CallValues:
    """The ``model_calls`` values of one record (see the module docstring)."""
    api = header.api or ""
    http_status = header.http_status
    parsed = parse_response(api, header.stream, response, http_status=http_status)
    token_source: str | None = header.token_source
    prompt, choice_ids, choice_lps = _token_lists(header, parsed, token_source)
    if token_source is None:
        has_prompt = prompt is not None or any(c.prompt_token_ids is not None for c in parsed.choices)
        token_source = "upstream" if has_prompt or any(x is not None for x in choice_ids) else "none"
    stamp = header.policy_version
    engine_version = rows.int_value(parsed.policy_version, "response policy_version", 0, rows.INT64_MAX)
    mismatch = stamp is not None and engine_version is not None and stamp != engine_version
    status: str | None = header.status
    stream_error = status == "ok" and (parsed.stream_error or parsed.error is not None)
    if stream_error:
        # a 200 answer that is an error: mostly a stream whose last event is one (the engine stopped part-way)
        status = "upstream_error"
    prompt_tokens = rows.int_value(parsed.prompt_tokens, "usage prompt_tokens")
    if prompt_tokens is None and prompt is not None:
        prompt_tokens = len(prompt)
    usage_completion = rows.int_value(parsed.completion_tokens, "usage completion_tokens")
    changes = bytes(header.request_changes)
    t_start, t_end = header.t_start, header.t_end
    call = {
        "call_id": header.call_id,
        "run_id": header.run_id,
        "iteration": header.iteration,
        "rollout_id": header.rollout_id,
        "seq": header.seq,
        "api": api,
        "path": header.path,
        "stream": header.stream,
        "request": request,
        "request_changes": None if changes == _NULL else changes.decode(),
        "response": parsed.response,
        "status": status,
        "http_status": http_status,
        "error": header.error or rows.text(parsed.error),
        "model": header.model or rows.text(parsed.model),
        # the engine knows which weights sampled the call; the proxy's stamp can lag a publish it was not told of
        "policy_version": stamp if engine_version is None else engine_version,
        "proxy_policy_version": stamp,
        "token_source": token_source,
        "spliced_tokens": rows.int_value(parsed.spliced_tokens, "response spliced_tokens"),
        "t_start": None if t_start is None else int(t_start * 1_000_000),
        "t_end": None if t_end is None else int(t_end * 1_000_000),
        "latency_ms": (t_end - t_start) * 1000.0 if t_start is not None and t_end is not None else None,
        "upstream_ms": header.upstream_ms,
        "segment": seg,
        "offset": off,
    }
    n_rows = max(1, len(choice_ids))
    indexes = _choice_indexes(parsed, n_rows)
    choices = []
    for i in range(n_rows):
        choice = parsed.choices[i] if i < len(parsed.choices) else None
        row_prompt = prompt
        if choice is not None and choice.prompt_token_ids is not None and token_source != "retokenized":
            row_prompt = rows.id_list(choice.prompt_token_ids, "prompt_token_ids", parsed.typed)
        ids = choice_ids[i] if i < len(choice_ids) else None
        tools = choice.tool_calls if choice is not None else None
        choices.append(
            {
                "choice_index": indexes[i],
                "prompt_token_ids": row_prompt,
                "completion_token_ids": ids,
                "completion_logprobs": choice_lps[i] if i < len(choice_lps) else None,
                "finish_reason": rows.text(choice.finish_reason) if choice is not None else None,
                "prompt_tokens": prompt_tokens if prompt_tokens is not None or row_prompt is None else len(row_prompt),
                "completion_tokens": len(ids) if ids is not None else usage_completion if n_rows == 1 else None,
                "tool_calls": None if not tools else orjson.dumps(tools).decode(),
            }
        )
    return CallValues(call, choices, mismatch, stream_error)


def _choice_indexes(parsed: ParsedCall, n_rows: int) -> list[int]:
    """Each row's choice_index: the index the server gave its choice (its place in the list where it gave
    none). A call's rows are told apart by it (the trees' call-to-path link, training's join of a call with
    its place in the trees), so where the server repeats an index (a gateway that makes n calls of one
    choice each answers index 0 n times), every row takes its place in the list instead: two rows with one
    index would each be joined to the other's path and trained with the other's logprobs."""
    if n_rows == 1:  # most calls: nothing to repeat
        index = rows.int_value(parsed.choices[0].index, "choice index") if parsed.choices else None
        return [0 if index is None else index]
    given = [
        rows.int_value(parsed.choices[i].index, "choice index") if i < len(parsed.choices) else None
        for i in range(n_rows)
    ]
    indexes = [i if x is None else x for i, x in enumerate(given)]
    if len(set(indexes)) < len(indexes):
        log.debug("choices of one call repeat an index (%s): numbered by their place instead", indexes)
        return list(range(n_rows))
    return indexes


def _token_lists(
    header: capture.CaptureHeader, parsed: ParsedCall, token_source: str | None
) -> tuple[Any, list[Any], list[Any]]:
    """(prompt ids, ids per choice, logprobs per choice), their element types checked: the upstream's, or the
    proxy's own encoding for a retokenized call (never mixed)."""
    typed = parsed.typed
    prompt: Any = parsed.prompt_token_ids
    choice_ids: list[Any] = [c.token_ids for c in parsed.choices]
    choice_lps: list[Any] = [c.logprobs for c in parsed.choices]
    if token_source == "retokenized":
        retok = header.retokenized
        prompt = retok.prompt_token_ids if retok is not None else None
        rchoices = retok.choices if retok is not None else []
        n = max(len(parsed.choices), len(rchoices))
        choice_ids = [rchoices[i].token_ids if i < len(rchoices) else None for i in range(n)]
        choice_lps = [None] * n
        typed = True  # the header's struct checked them (list[int])
    if typed:  # a typed reader checked the element types already
        return prompt, choice_ids, choice_lps
    prompt = rows.id_list(prompt, "prompt_token_ids", typed)
    choice_ids = [rows.id_list(x, "completion_token_ids", typed) for x in choice_ids]
    choice_lps = [rows.logprob_list(x, "completion_logprobs", typed) for x in choice_lps]
    return prompt, choice_ids, choice_lps
