"""Captures of calls shaped like APIs and harnesses the pipeline has not met before, for landing and tree tests.

Records are framed by :func:`clawpipe.capture.encode_record` (what the proxy's segment writer appends) into a
segment file, landed with :func:`clawpipe.lake.land`, and read back from the lake with SQL. Prompt ids, where a
test wants them, come from :func:`prompt_ids`: the request's chat-template messages (the conversion the engine
renders) spelt as UTF-8 bytes, so two prompts share exactly the ids of the text they share.
"""

from __future__ import annotations

import json
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
    parts = [f"<tools>{json.dumps(tools, sort_keys=True)}</tools>"] if tools else []
    for m in messages:
        calls = "".join(f"<call>{json.dumps(c['function'], sort_keys=True)}</call>" for c in m.get("tool_calls") or ())
        parts.append(f"<{m['role']}>{m['content']}{calls}</{m['role']}>")
    return "".join(parts) + "<assistant>"


def ids(text: str) -> list[int]:
    return list(text.encode())


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
