"""Capture records in every API's real response shape (docs/ARCHITECTURE.md, contract A), streamed and not, for lake
tests.

``response_body(api, stream, completion)`` renders one completion the way the engine (or vLLM, or an
Anthropic/OpenAI-compatible server) would return it; ``record(...)`` frames it with a proxy header.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clawpipe import capture

APIS = ("chat", "completions", "responses", "messages")
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}


@dataclass
class Completion:
    prompt_ids: list[int] = field(default_factory=lambda: [101, 102, 103, 104])
    ids: list[int] = field(default_factory=lambda: [7, 8, 9])
    logprobs: list[float] = field(default_factory=lambda: [-0.5, -0.25, -0.125])
    pieces: list[str] = field(default_factory=lambda: ["Hel", "lo", "!"])
    tool: tuple[str, dict[str, Any]] | None = None  # (name, arguments)
    finish: str = "stop"  # stop | length | tool_calls (OpenAI words)
    policy_version: int = 3
    model: str = "tiny"


def _lp_entries(c: Completion) -> list[dict[str, Any]]:
    return [
        {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
        for p, lp in zip(c.pieces, c.logprobs, strict=True)
    ]


def _sse(events: list[tuple[str | None, Any]]) -> bytes:
    out = []
    for name, data in events:
        text = data if isinstance(data, str) else json.dumps(data)
        out.append((f"event: {name}\n" if name else "") + f"data: {text}\n\n")
    return "".join(out).encode()


def _usage_openai(c: Completion) -> dict[str, int]:
    return {"prompt_tokens": len(c.prompt_ids), "completion_tokens": len(c.ids), "total_tokens": 0}


def _chat(c: Completion, stream: bool, api: str) -> bytes:
    text = "".join(c.pieces)
    tool_calls = None
    if c.tool:
        tool_calls = [
            {"id": "call_1", "type": "function", "function": {"name": c.tool[0], "arguments": json.dumps(c.tool[1])}}
        ]
    if not stream:
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": c.finish,
            "token_ids": c.ids,
            "logprobs": {"content": _lp_entries(c)},
        }
        if api == "chat":
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": tool_calls}
        else:
            choice["text"] = text
        return json.dumps(
            {
                "id": "cmpl-1",
                "object": "chat.completion" if api == "chat" else "text_completion",
                "created": 1,
                "model": c.model,
                "policy_version": c.policy_version,
                "prompt_token_ids": c.prompt_ids,
                "choices": [choice],
                "usage": _usage_openai(c),
            }
        ).encode()
    obj = "chat.completion.chunk" if api == "chat" else "text_completion"
    events: list[tuple[str | None, Any]] = []
    first: dict[str, Any] = {
        "id": "cmpl-1",
        "object": obj,
        "created": 1,
        "model": c.model,
        "policy_version": c.policy_version,
    }
    first["prompt_token_ids"] = c.prompt_ids
    if api == "chat":
        first["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
    else:
        first["choices"] = [{"index": 0, "text": "", "finish_reason": None}]
    events.append((None, first))
    for piece, tid, entry in zip(c.pieces, c.ids, _lp_entries(c), strict=True):
        ch: dict[str, Any] = {"index": 0, "finish_reason": None, "token_ids": [tid], "logprobs": {"content": [entry]}}
        if api == "chat":
            ch["delta"] = {"content": piece}
        else:
            ch["text"] = piece
        events.append((None, {"id": "cmpl-1", "object": obj, "choices": [ch]}))
    if tool_calls and api == "chat":
        args = tool_calls[0]["function"]["arguments"]
        half = len(args) // 2
        d1 = {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": c.tool[0], "arguments": args[:half]},
                }
            ]
        }
        d2 = {"tool_calls": [{"index": 0, "function": {"arguments": args[half:]}}]}
        for d in (d1, d2):
            events.append(
                (None, {"id": "cmpl-1", "object": obj, "choices": [{"index": 0, "delta": d, "finish_reason": None}]})
            )
    last: dict[str, Any] = {"index": 0, "finish_reason": c.finish}
    last["delta" if api == "chat" else "text"] = {} if api == "chat" else ""
    events.append((None, {"id": "cmpl-1", "object": obj, "choices": [last]}))
    events.append((None, {"id": "cmpl-1", "object": obj, "choices": [], "usage": _usage_openai(c)}))
    events.append((None, "[DONE]"))
    return _sse(events)


_TO_MESSAGES = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _messages(c: Completion, stream: bool) -> bytes:
    text = "".join(c.pieces)
    usage = {"input_tokens": len(c.prompt_ids), "output_tokens": len(c.ids)}
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if c.tool:
        content.append({"type": "tool_use", "id": "call_1", "name": c.tool[0], "input": c.tool[1]})
    if not stream:
        return json.dumps(
            {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": c.model,
                "content": content,
                "stop_reason": _TO_MESSAGES[c.finish],
                "stop_sequence": None,
                "usage": usage,
                "policy_version": c.policy_version,
                "prompt_token_ids": c.prompt_ids,
                "token_ids": c.ids,
                "logprobs": {"content": [{"token": e["token"], "logprob": e["logprob"]} for e in _lp_entries(c)]},
            }
        ).encode()
    start = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": c.model,
        "content": [],
        "stop_reason": None,
        "usage": {"input_tokens": len(c.prompt_ids), "output_tokens": 1},
        "policy_version": c.policy_version,
        "prompt_token_ids": c.prompt_ids,
    }
    ev: list[tuple[str | None, Any]] = [("message_start", {"type": "message_start", "message": start})]
    ev.append(
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        )
    )
    ev.append(("ping", {"type": "ping"}))
    for piece in c.pieces:
        ev.append(
            (
                "content_block_delta",
                {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}},
            )
        )
    ev.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
    if c.tool:
        block = {"type": "tool_use", "id": "call_1", "name": c.tool[0], "input": {}}
        ev.append(("content_block_start", {"type": "content_block_start", "index": 1, "content_block": block}))
        args = json.dumps(c.tool[1])
        for part in (args[:3], args[3:]):
            delta = {"type": "input_json_delta", "partial_json": part}
            ev.append(("content_block_delta", {"type": "content_block_delta", "index": 1, "delta": delta}))
        ev.append(("content_block_stop", {"type": "content_block_stop", "index": 1}))
    ev.append(
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": _TO_MESSAGES[c.finish], "stop_sequence": None},
                "usage": {"output_tokens": len(c.ids)},
                "token_ids": c.ids,
                "logprobs": {"content": [{"token": e["token"], "logprob": e["logprob"]} for e in _lp_entries(c)]},
            },
        )
    )
    ev.append(("message_stop", {"type": "message_stop"}))
    return _sse(ev)


def _responses(c: Completion, stream: bool) -> bytes:
    text = "".join(c.pieces)
    output: list[dict[str, Any]] = [
        {"type": "message", "id": "m1", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    ]
    if c.tool:
        output.append(
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": c.tool[0],
                "arguments": json.dumps(c.tool[1]),
            }
        )
    full: dict[str, Any] = {
        "id": "resp_1",
        "object": "response",
        "model": c.model,
        "status": "incomplete" if c.finish == "length" else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if c.finish == "length" else None,
        "output": output,
        "usage": {"input_tokens": len(c.prompt_ids), "output_tokens": len(c.ids), "total_tokens": 0},
        "policy_version": c.policy_version,
        "prompt_token_ids": c.prompt_ids,
        "token_ids": c.ids,
        "logprobs": {"content": [{"token": e["token"], "logprob": e["logprob"]} for e in _lp_entries(c)]},
    }
    if not stream:
        return json.dumps(full).encode()
    created = {"id": "resp_1", "object": "response", "status": "in_progress", "policy_version": c.policy_version}
    ev: list[tuple[str | None, Any]] = [("response.created", {"type": "response.created", "response": created})]
    for piece in c.pieces:
        ev.append(
            ("response.output_text.delta", {"type": "response.output_text.delta", "output_index": 0, "delta": piece})
        )
    for i, item in enumerate(output):
        ev.append(("response.output_item.done", {"type": "response.output_item.done", "output_index": i, "item": item}))
    kind = "response.incomplete" if c.finish == "length" else "response.completed"
    ev.append((kind, {"type": kind, "response": full}))
    return _sse(ev)


def response_body(api: str, stream: bool, c: Completion | None = None) -> bytes:
    c = c or Completion()
    if api in ("chat", "completions"):
        return _chat(c, stream, api)
    if api == "messages":
        return _messages(c, stream)
    if api == "responses":
        return _responses(c, stream)
    raise ValueError(api)


def header(
    *,
    api: str = "chat",
    stream: bool = False,
    run_id: str = "run1",
    iteration: int = 0,
    rollout_id: str = "r0",
    seq: int = 0,
    call_id: str | None = None,
    status: str = "ok",
    http_status: int = 200,
    error: str | None = None,
    token_source: str = "upstream",
    retokenized: dict[str, Any] | None = None,
    policy_version: int | None = 3,
    t_start: float | None = None,
    latency_s: float = 0.05,
) -> dict[str, Any]:
    t0 = time.time() if t_start is None else t_start
    h: dict[str, Any] = {
        "call_id": call_id or uuid.uuid4().hex,
        "run_id": run_id,
        "iteration": iteration,
        "rollout_id": rollout_id,
        "seq": seq,
        "api": api,
        "method": "POST",
        "path": PATHS.get(api, "/v1/models"),
        "query": "",
        "stream": stream,
        "http_status": http_status,
        "status": status,
        "error": error,
        "model": "tiny",
        "policy_version": policy_version,
        "t_start": t0,
        "t_end": t0 + latency_s,
        "upstream_ms": latency_s * 800,
        "request_changes": {"return_token_ids": True},
        "token_source": token_source,
        "upstream": "http://127.0.0.1:1",
    }
    if retokenized is not None:
        h["retokenized"] = retokenized
    return h


def request_body(api: str, stream: bool) -> bytes:
    if api == "messages":
        body = {"model": "tiny", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    elif api == "responses":
        body = {"model": "tiny", "input": "hi", "stream": stream}
    elif api == "completions":
        body = {"model": "tiny", "prompt": "hi", "stream": stream}
    else:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return json.dumps(body).encode()


def record(api: str = "chat", stream: bool = False, c: Completion | None = None, **hdr: Any) -> bytes:
    return capture.encode_record(
        header(api=api, stream=stream, **hdr), request_body(api, stream), response_body(api, stream, c)
    )


def write_segment(path: Path, frames: list[bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(frames))
    return path


def rollout_row(rollout_id: str, *, run_id: str = "run1", iteration: int = 0, **kw: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "rollout_id": rollout_id,
        "run_id": run_id,
        "iteration": iteration,
        "group_id": "g0",
        "harness": "chat-loop",
        "task_set": "guess",
        "task_id": "t0",
        "sample_idx": 0,
        "backend": "process",
        "status": "succeeded",
        "exit_code": 0,
        "reward": 1.0,
        "reward_info": {"ok": True},
        "n_calls": 1,
        "started_at": "2026-11-30T03:00:00+00:00",
        "ended_at": "2026-11-30T03:00:01.500000+00:00",
        "duration_s": 1.5,
        "stderr_tail": "",
        "error": None,
        "attempt": 0,
        "policy_version": 3,
        "eval": False,
    }
    row.update(kw)
    return row


def write_results(captures: Path, rows: list[dict[str, Any]], *, batch: str = "b0") -> Path:
    by_part: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        by_part.setdefault((r["run_id"], r["iteration"]), []).append(r)
    path = captures
    for (run, it), part_rows in by_part.items():
        d = captures / "results" / run / str(it)
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"results-{batch}.jsonl"
        for r in part_rows:
            capture.append_result(path, r)
    return path


def rollout_segments(cap: Path, n_segments: int, per_segment: int, *, iterations: int = 1) -> int:
    """``n_segments`` segments of one rollout each (``per_segment`` calls, ids ``s<k>-c<i>``), spread over
    ``iterations`` iterations, with the rollouts' result rows; returns the number of calls written."""
    for s in range(n_segments):
        frames = [
            record(call_id=f"s{s}-c{i}", rollout_id=f"r{s}", seq=i, iteration=s % iterations)
            for i in range(per_segment)
        ]
        write_segment(cap / f"proxy-{s:06d}.seg", frames)
    write_results(cap, [rollout_row(f"r{s}", iteration=s % iterations) for s in range(n_segments)])
    return n_segments * per_segment
