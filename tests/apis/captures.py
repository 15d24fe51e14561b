"""Captures of calls shaped like APIs and harnesses the pipeline has not met before, for landing and tree tests.

Records are framed by :func:`clawpipe.capture.encode_record` (what the proxy's segment writer appends) into a
segment file, landed with :func:`clawpipe.lake.land`, and read back from the lake with SQL. Prompt ids, where a
test wants them, come from :func:`prompt_ids`: the request's chat-template messages (the conversion the engine
renders) as text, split into words, punctuation and template tags, so two prompts share exactly the ids of the
text they share up to a token boundary.
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path
from typing import Any

from clawpipe import capture
from clawpipe.apis import request_messages
from clawpipe.lake import land, run_sql
from tests.lake import fixtures as fx

RUN = "run-unseen"


def sse(events: list[Any], *, named: bool = True) -> bytes:
    """An SSE body: each event a JSON object (``event:`` line from its ``type`` when ``named``) or a raw string."""
    out = []
    for ev in events:
        data = ev if isinstance(ev, str) else json.dumps(ev)
        name = ev.get("type") if named and isinstance(ev, dict) else None
        out.append((f"event: {name}\n" if name else "") + f"data: {data}\n\n")
    return "".join(out).encode()


def render(api: str, body: dict[str, Any]) -> str:
    """The request's template messages and tools as one text, turn by turn, ending with the assistant cue."""
    messages, tools = request_messages(api, body)
    parts = []
    for i, m in enumerate(messages):
        if i == int(messages[0]["role"] == "system") and tools:  # tools after the system prompt, as templates do
            parts.append(f"<tools>{json.dumps(tools, sort_keys=True)}</tools>")
        calls = "".join(f"<call>{json.dumps(c['function'], sort_keys=True)}</call>" for c in m.get("tool_calls") or ())
        parts.append(f"<{m['role']}>{m['content']}{calls}</{m['role']}>")
    return "".join(parts) + "<assistant>"


# a word-level vocabulary with the template's tags as special tokens: a prompt and the answer after it meet at a
# tag, so the prompt's ids are a prefix of the next prompt's, as with a real tokenizer's special tokens
_TOKEN = re.compile(r"</?[a-z]+>|\w+|[^\w\s<]+|<|\s+")


def ids(text: str) -> list[int]:
    """Token ids of ``text``: one per tag, word, run of punctuation or run of spaces (a stable hash)."""
    return [zlib.crc32(t.encode()) % 150_000 + 256 for t in _TOKEN.findall(text)]


def prompt_ids(api: str, body: dict[str, Any]) -> list[int]:
    return ids(render(api, body))


def record(
    api: str, request: dict[str, Any], response: bytes, *, stream: bool, seq: int, call_id: str, **hdr: Any
) -> bytes:
    hdr.setdefault("run_id", RUN)
    h = fx.header(api=api, stream=stream, seq=seq, call_id=call_id, **hdr)
    return capture.encode_record(h, json.dumps({**request, "stream": stream}).encode(), response)


def land_frames(tmp_path: Path, frames: list[bytes], rollouts: list[dict[str, Any]] | None = None) -> Path:
    """Write the frames as one segment (and the rollouts' results), land them; the lake's path. Every record
    becomes a call or a reject, never neither."""
    fx.write_segment(tmp_path / "cap" / "p-000001.seg", frames)
    if rollouts:
        fx.write_results(tmp_path / "cap", [fx.rollout_row(run_id=RUN, **r) for r in rollouts])
    report = land(tmp_path / "cap", tmp_path / "lake")
    assert report.calls + report.rejects == len(frames), report
    return tmp_path / "lake"


def calls(lake: Path) -> list[dict[str, Any]]:
    return run_sql(lake, "select * from model_calls order by seq, choice_index").to_pylist()


def rejects(lake: Path) -> list[dict[str, Any]]:
    return run_sql(lake, "select * from rejects").to_pylist()


# -- a harness talking Anthropic Messages to an engine that returns ids ------------------------------------


def answer_ids(api: str, request: dict[str, Any], message: dict[str, Any]) -> list[int]:
    """The ids the engine samples for ``message`` (an assistant message in the request's own shape): the
    text the template renders for it when it is sent back, so the next prompt holds exactly these ids."""
    key = "input" if api == "responses" else "messages"
    before = render(api, request)
    after = render(api, {**request, key: [*request[key], message]})
    assert after.startswith(before), "an answer must extend the prompt it follows"
    return ids(after[len(before) : -len("<assistant>")])


def messages_answer(request: dict[str, Any], content: list[dict[str, Any]], *, rid: str) -> tuple[bytes, list[int]]:
    """A plain Messages response as the engine gives it (prompt ids, sampled ids, logprobs), and its ids."""
    completion = answer_ids("messages", request, {"role": "assistant", "content": content})
    stop = "tool_use" if any(b["type"] == "tool_use" for b in content) else "end_turn"
    body = {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": "claude-x",
        "content": content,
        "stop_reason": stop,
        "usage": {"input_tokens": 0, "output_tokens": len(completion)},
        "prompt_token_ids": prompt_ids("messages", request),
        "token_ids": completion,
        "logprobs": {"content": [{"token": "t", "logprob": -0.25} for _ in completion]},
        "policy_version": 3,
    }
    return json.dumps(body).encode(), completion
