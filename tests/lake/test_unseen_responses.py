"""OpenAI Responses calls shaped unlike the engine's, landed from real capture segments: reasoning items with
encrypted content, function_call and function_call_output items, ``store: false``, ``response.failed`` and
``response.incomplete``, and turns chained by ``previous_response_id`` (the request holds only the new input)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clawpipe.trees import build_iteration
from tests.apis import captures as cx
from tests.trees.fixtures import locate, read_stats, read_tree

TOOLS = [{"type": "function", "name": "sh", "parameters": {"type": "object"}}, {"type": "web_search"}]
FIRST = {"model": "o-x", "instructions": "Be brief.", "input": "Count the files.", "tools": TOOLS, "store": False}
REASONING = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA-opaque"}
CALL = {"type": "function_call", "id": "fc_1", "call_id": "call_sh", "name": "sh", "arguments": '{"cmd": "ls | wc -l"}'}
RESULT = {"type": "function_call_output", "call_id": "call_sh", "output": "3"}


def _ev(kind: str, **kw: Any) -> dict[str, Any]:
    return {"type": kind, **kw}


def response(rid: str, status: str, output: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return {"id": rid, "object": "response", "status": status, "model": "o-x", "output": output, **kw}


def stream(rid: str, final_kind: str, final: dict[str, Any], items: list[dict[str, Any]]) -> bytes:
    evs = [_ev("response.created", response=response(rid, "in_progress", []))]
    for i, item in enumerate(items):
        evs.append(_ev("response.output_item.added", output_index=i, item={**item, "status": "in_progress"}))
        if item["type"] == "function_call":
            half = len(item["arguments"]) // 2
            for part in (item["arguments"][:half], item["arguments"][half:]):
                evs.append(_ev("response.function_call_arguments.delta", output_index=i, delta=part))
        evs.append(_ev("response.output_item.done", output_index=i, item=item))
    evs.append(_ev(final_kind, response=final))
    return cx.sse(evs)


def test_reasoning_and_a_function_call_of_a_store_false_stream_land_with_the_call_and_the_item(tmp_path: Path) -> None:
    usage = {"input_tokens": 30, "output_tokens": 12, "output_tokens_details": {"reasoning_tokens": 8}}
    final = response("resp_1", "completed", [REASONING, CALL], usage=usage, store=False)
    body = stream("resp_1", "response.completed", final, [REASONING, CALL])
    lake = cx.land_frames(tmp_path, [cx.record("responses", FIRST, body, stream=True, seq=0, call_id="r-1")])
    assert cx.rejects(lake) == []
    (row,) = cx.calls(lake)
    assert row["status"] == "ok" and row["finish_reason"] == "tool_calls"
    assert (row["prompt_tokens"], row["completion_tokens"]) == (30, 12)
    (tool,) = json.loads(row["tool_calls"])
    assert tool["id"] == "call_sh" and json.loads(tool["function"]["arguments"]) == {"cmd": "ls | wc -l"}
    got = cx.run_sql(
        lake,
        "select json_extract_string(response, '$.output[0].encrypted_content') as enc, "
        "json_extract_string(request, '$.store') as store from model_calls",
    ).to_pylist()
    assert got == [{"enc": "gAAAA-opaque", "store": "false"}]


def test_failed_and_incomplete_streams_land_with_their_outcome_and_prompt(tmp_path: Path) -> None:
    err = {"code": "server_error", "message": "The model crashed."}
    failed = response("resp_f", "failed", [REASONING], error=err, prompt_token_ids=[9, 8, 7], usage=None)
    cut = response(
        "resp_i",
        "incomplete",
        [REASONING],
        incomplete_details={"reason": "max_output_tokens"},
        usage={"input_tokens": 3, "output_tokens": 64},
    )
    frames = [
        cx.record(
            "responses",
            FIRST,
            stream("resp_f", "response.failed", failed, [REASONING]),
            stream=True,
            seq=0,
            call_id="f",
        ),
        cx.record(
            "responses",
            FIRST,
            stream("resp_i", "response.incomplete", cut, [REASONING]),
            stream=True,
            seq=1,
            call_id="i",
        ),
    ]
    lake = cx.land_frames(tmp_path, frames)
    assert cx.rejects(lake) == []
    f, i = cx.calls(lake)
    assert (f["status"], f["error"], f["finish_reason"]) == ("upstream_error", "The model crashed.", "error")
    assert f["prompt_token_ids"] == [9, 8, 7]
    assert (i["status"], i["error"], i["finish_reason"], i["completion_tokens"]) == ("ok", None, "length", 64)


# -- previous_response_id chains ---------------------------------------------------------------------------


def _engine_turn(rid: str, request: dict[str, Any], prompt: list[int], completion: list[int], items: list[dict]):
    """A plain response as the engine gives it: the ids of the whole conversation it ran on, and its own."""
    body = response(rid, "completed", items, prompt_token_ids=prompt, token_ids=completion, policy_version=3)
    body["previous_response_id"] = request.get("previous_response_id")
    body["logprobs"] = {"content": [{"token": "t", "logprob": -0.5} for _ in completion]}
    return json.dumps(body).encode()


def _chain() -> tuple[list[int], list[int], list[int], list[int], dict[str, Any], dict[str, Any]]:
    """Turn one asks, calls a tool; turn two sends only the tool's output and the first response's id."""
    first = {**FIRST, "store": True}
    p1 = cx.prompt_ids("responses", first)
    g1 = cx.ids('<call>{"name": "sh"}</call>')
    second = {"model": "o-x", "previous_response_id": "resp_A", "input": [RESULT], "tools": TOOLS}
    # the engine expands previous_response_id: the stored input and output come before the new input
    p2 = p1 + g1 + cx.ids("</assistant><tool>3</tool><assistant>")
    g2 = cx.ids("There are 3 files.")
    return p1, g1, p2, g2, first, second


def test_a_turn_chained_by_previous_response_id_is_a_child_of_the_call_it_names(tmp_path: Path) -> None:
    p1, g1, p2, g2, first, second = _chain()
    frames = [
        cx.record(
            "responses",
            first,
            _engine_turn("resp_A", first, p1, g1, [REASONING, CALL]),
            stream=False,
            seq=0,
            call_id="turn1",
        ),
        cx.record(
            "responses", second, _engine_turn("resp_B", second, p2, g2, []), stream=False, seq=1, call_id="turn2"
        ),
    ]
    lake = cx.land_frames(tmp_path, frames, [{"rollout_id": "r0", "reward": 1.0}])
    assert cx.rejects(lake) == []
    build_iteration(lake, cx.RUN, 0)
    nodes = read_tree(lake, cx.RUN, 0, "rollout:r0")
    stats = read_stats(lake, cx.RUN, 0)["rollout:r0"]
    g1_node = nodes[locate(nodes, p1 + g1)[-1]]
    assert g1_node["generated"] and g1_node["call_id"] == "turn1" and g1_node["n_seqs"] == 2
    tool_node = nodes[locate(nodes, p2)[-1]]
    assert tool_node["parent_id"] == g1_node["node_id"] and not tool_node["generated"]
    leaf = nodes[locate(nodes, p2 + g2)[-1]]
    assert leaf["generated"] and leaf["call_id"] == "turn2" and leaf["parent_id"] == tool_node["node_id"]
    assert stats["n_leaves"] == 1 and stats["unique_tokens"] == len(p2 + g2)
    assert sum(stats[f"branches_{c}"] for c in ("retry", "choice", "rewrite", "subagent", "drift")) == 0


def test_a_chained_turn_whose_named_call_is_not_in_the_lake_starts_from_context_alone(tmp_path: Path) -> None:
    p1, g1, p2, g2, _, second = _chain()
    frames = [
        cx.record("responses", second, _engine_turn("resp_B", second, p2, g2, []), stream=False, seq=1, call_id="turn2")
    ]
    lake = cx.land_frames(tmp_path, frames, [{"rollout_id": "r0", "reward": 1.0}])
    build_iteration(lake, cx.RUN, 0)
    nodes = read_tree(lake, cx.RUN, 0, "rollout:r0")
    path = locate(nodes, p2 + g2)
    assert path is not None
    # turn one's answer is in the prompt, but nothing in this lake sampled it: it is context, not trained
    assert [nodes[i]["generated"] for i in path] == [False, True]
    assert nodes[path[0]]["token_ids"] == p2 and nodes[path[1]]["call_id"] == "turn2"
    assert locate(nodes, p1 + g1, partial=True) == [path[0]]


def test_a_turn_naming_a_response_stored_nowhere_lands_as_its_http_error_and_stays_out_of_the_trees(
    tmp_path: Path,
) -> None:
    _, _, _, _, _, second = _chain()
    err = {
        "error": {
            "message": "Previous response with id 'resp_A' not found.",
            "type": "invalid_request_error",
            "param": "previous_response_id",
            "code": "previous_response_not_found",
        }
    }
    frame = cx.record(
        "responses",
        second,
        json.dumps(err).encode(),
        stream=False,
        seq=0,
        call_id="lost",
        status="http_error",
        http_status=400,
        token_source="none",
    )
    lake = cx.land_frames(tmp_path, [frame], [{"rollout_id": "r0", "reward": 0.0}])
    assert cx.rejects(lake) == []
    (row,) = cx.calls(lake)
    assert (row["status"], row["http_status"]) == ("http_error", 400)
    assert row["error"] == "Previous response with id 'resp_A' not found."
    assert json.loads(row["request"])["previous_response_id"] == "resp_A"
    build_iteration(lake, cx.RUN, 0)
    stats = read_stats(lake, cx.RUN, 0)["rollout:r0"]
    assert (stats["n_calls"], stats["n_seqs"], stats["kept_out_no_ids"], stats["failed_calls"]) == (1, 0, 1, 1)


def test_a_stream_cut_before_its_items_were_done_keeps_their_text_and_arguments_so_far(tmp_path: Path) -> None:
    message = {"type": "message", "id": "msg_1", "role": "assistant", "status": "in_progress", "content": []}
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_sh", "name": "sh", "arguments": ""}
    events = [
        _ev("response.created", response=response("resp_c", "in_progress", [])),
        _ev("response.output_item.added", output_index=0, item=REASONING),
        _ev("response.reasoning_summary_text.delta", output_index=0, summary_index=0, delta="Plan: "),
        _ev("response.reasoning_summary_text.delta", output_index=0, summary_index=0, delta="list."),
        _ev("response.output_item.added", output_index=1, item=message),
        _ev("response.output_text.delta", output_index=1, content_index=0, delta="Listing "),
        _ev("response.output_text.delta", output_index=1, content_index=0, delta="now."),
        _ev("response.output_item.added", output_index=2, item=call),
        _ev("response.function_call_arguments.delta", output_index=2, delta='{"cmd": '),
        _ev("response.function_call_arguments.delta", output_index=2, delta='"ls'),
    ]
    frame = cx.record(
        "responses",
        FIRST,
        cx.sse(events),
        stream=True,
        seq=0,
        call_id="cut",
        status="upstream_error",
        error="upstream closed the stream",
    )
    lake = cx.land_frames(tmp_path, [frame])
    assert cx.rejects(lake) == []
    (row,) = cx.calls(lake)
    assert (row["status"], row["error"]) == ("upstream_error", "upstream closed the stream")
    out = json.loads(row["response"])["output"]
    assert out[0]["summary"] == [{"type": "summary_text", "text": "Plan: list."}]
    assert out[0]["encrypted_content"] == "gAAAA-opaque"
    assert out[1]["content"] == [{"type": "output_text", "text": "Listing now."}]
    assert out[2]["arguments"] == '{"cmd": "ls'


def test_a_failed_response_listing_no_output_keeps_the_items_it_streamed(tmp_path: Path) -> None:
    err = {"code": "server_error", "message": "The model crashed."}
    body = stream("resp_f", "response.failed", response("resp_f", "failed", [], error=err), [REASONING, CALL])
    lake = cx.land_frames(tmp_path, [cx.record("responses", FIRST, body, stream=True, seq=0, call_id="f")])
    (row,) = cx.calls(lake)
    assert (row["status"], row["error"], row["finish_reason"]) == ("upstream_error", "The model crashed.", "error")
    assert json.loads(row["response"])["output"] == [REASONING, CALL]
