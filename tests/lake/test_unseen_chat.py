"""Chat-completions streams shaped unlike the engine's, landed from real capture segments: n=2 with the choices'
chunks interleaved, parallel tool calls streamed by index with arguments split across chunks and no ids, a refusal
streamed in deltas, ``delta.role`` only once, ``logprobs: null`` on chunks without tokens and a usage-only last
chunk (``stream_options.include_usage``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from clawpipe.trees import build_iteration
from tests.apis import captures as cx
from tests.trees.fixtures import locate, read_stats, read_tree

REQUEST = {
    "model": "gpt-x",
    "n": 2,
    "messages": [{"role": "user", "content": "List / and read a."}],
    "tools": [
        {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "cat", "parameters": {"type": "object"}}},
    ],
    "stream_options": {"include_usage": True},
}
PROMPT = [1, 2, 3, 4, 5]


def _chunk(choices: list[dict[str, Any]], **top: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-9",
        "object": "chat.completion.chunk",
        "created": 7,
        "model": "gpt-x",
        **top,
        "choices": choices,
    }


def _c(index: int, delta: dict[str, Any], ids: list[int] | None = None, lps: list[float] | None = None, **kw: Any):
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None, **kw}
    if ids is not None:
        choice["token_ids"] = ids
        choice["logprobs"] = {
            "content": [{"token": "t", "logprob": lp, "bytes": [], "top_logprobs": []} for lp in lps or ()]
        }
    return choice


def _tool(index: int, args: str, name: str | None = None) -> dict[str, Any]:
    fn: dict[str, Any] = {"arguments": args}
    if name is not None:
        fn["name"] = name
    return {"tool_calls": [{"index": index, **({"type": "function"} if name else {}), "function": fn}]}


def interleaved_stream() -> list[Any]:
    """Choice 0 calls ls and cat in parallel (arguments split across chunks, no ids); choice 1 refuses."""
    return [
        _chunk([_c(0, {"role": "assistant", "content": ""})], prompt_token_ids=PROMPT),
        _chunk([_c(1, {"role": "assistant", "content": None, "refusal": ""})]),
        _chunk([_c(0, _tool(0, "", "ls"), [40], [-0.1])]),
        _chunk([_c(1, {"refusal": "I can't "}, [50], [-0.5])]),
        _chunk([_c(0, _tool(1, '{"pa', "cat"), [41], [-0.2])]),
        _chunk([_c(0, _tool(0, '{"dir": "/'), [42], [-0.3])]),
        _chunk([_c(1, {"refusal": "help with that."}, [51, 52], [-0.6, -0.7])]),
        _chunk([_c(0, _tool(1, 'th": "a"}'), [43], [-0.4])]),
        _chunk([_c(0, _tool(0, '"}'), [44], [-0.45])]),
        _chunk([_c(1, {}, finish_reason="stop")]),
        _chunk([_c(0, {}, finish_reason="tool_calls")]),
        _chunk([], usage={"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}),
        "[DONE]",
    ]


def _land(tmp_path: Path) -> Path:
    frames = [cx.record("chat", REQUEST, cx.sse(interleaved_stream(), named=False), stream=True, seq=0, call_id="c-n2")]
    return cx.land_frames(tmp_path, frames, [{"rollout_id": "r0", "group_id": "g0", "reward": 1.0}])


def test_interleaved_choices_with_parallel_tool_calls_and_a_refusal_land_as_two_rows(tmp_path: Path) -> None:
    lake = _land(tmp_path)
    assert cx.rejects(lake) == []
    first, second = cx.calls(lake)
    assert (first["choice_index"], second["choice_index"]) == (0, 1)
    assert first["prompt_token_ids"] == PROMPT and second["prompt_token_ids"] == PROMPT
    assert first["completion_token_ids"] == [40, 41, 42, 43, 44]
    assert first["completion_logprobs"] == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.45])
    assert second["completion_token_ids"] == [50, 51, 52]
    assert first["finish_reason"] == "tool_calls" and second["finish_reason"] == "stop"
    tools = json.loads(first["tool_calls"])
    assert [(t["id"], t["function"]["name"], json.loads(t["function"]["arguments"])) for t in tools] == [
        (None, "ls", {"dir": "/"}),
        (None, "cat", {"path": "a"}),
    ]
    assert second["tool_calls"] is None
    # usage of the whole call from the usage-only chunk; per choice, its own token count
    assert first["prompt_tokens"] == 5 and (first["completion_tokens"], second["completion_tokens"]) == (5, 3)
    choices = json.loads(first["response"])["choices"]
    assert choices[1]["message"] == {"role": "assistant", "content": None, "refusal": "I can't help with that."}
    assert "refusal" not in choices[0]["message"] and choices[0]["message"]["content"] is None


def test_the_two_choices_are_sibling_generations_after_their_shared_prompt(tmp_path: Path) -> None:
    lake = _land(tmp_path)
    build_iteration(lake, cx.RUN, 0)
    stats = read_stats(lake, cx.RUN, 0)["rollout:r0"]
    nodes = read_tree(lake, cx.RUN, 0, "rollout:r0")
    assert stats["branches_choice"] == 1 and stats["n_leaves"] == 2 and stats["n_seqs"] == 2
    (prompt_node,) = (nodes[i] for i in locate(nodes, PROMPT))
    assert not prompt_node["generated"] and prompt_node["n_seqs"] == 2
    a = nodes[locate(nodes, [*PROMPT, 40, 41, 42, 43, 44])[-1]]
    b = nodes[locate(nodes, [*PROMPT, 50, 51, 52])[-1]]
    assert a["parent_id"] == b["parent_id"] == prompt_node["node_id"]
    assert a["generated"] and b["generated"] and {a["branch_cause"], b["branch_cause"]} == {None, "choice"}
    assert b["logprobs"] == pytest.approx([-0.5, -0.6, -0.7])


def test_content_and_arguments_cut_inside_a_surrogate_pair_land_whole(tmp_path: Path) -> None:
    """A server holding UTF-16 strings cuts a delta between the halves of a pair: each event's JSON holds
    one half as a lone \\uXXXX escape."""
    events = [
        _chunk([_c(0, {"role": "assistant", "content": "ok \ud83d"})]),
        _chunk([_c(0, {"content": "\ude00!"})]),
        _chunk([_c(0, _tool(0, '{"e": "\ud83c', "ls"))]),
        _chunk([_c(0, _tool(0, '\udf89"}'))]),
        _chunk([_c(0, {}, finish_reason="tool_calls")]),
        "[DONE]",
    ]
    body = cx.sse(events, named=False)
    frames = [cx.record("chat", REQUEST, body, stream=True, seq=0, call_id="c-utf16")]
    lake = cx.land_frames(tmp_path, frames)
    assert cx.rejects(lake) == []
    (row,) = cx.calls(lake)
    (tool,) = json.loads(row["tool_calls"])
    assert json.loads(tool["function"]["arguments"]) == {"e": "\U0001f389"}
    assert json.loads(row["response"])["choices"][0]["message"]["content"] == "ok \U0001f600!"
