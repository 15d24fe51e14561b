"""Chat streams from a vLLM server with a reasoning parser: the model's thinking streams in its own delta field
(``reasoning_content`` in older releases, ``reasoning`` in newer ones) before the answer's content. The landed
response keeps it under the name the server used, and the completion's ids and logprobs cover thinking and
answer alike, as the engine sampled them. The ``stop_reason`` vLLM streams with the last chunk is kept too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clawpipe.lake import run_sql
from tests.apis import captures as cx
from tests.lake.test_unseen_chat import _c, _chunk

REQUEST = {"model": "qwen3", "messages": [{"role": "user", "content": "2+2?"}], "stream": True}
PROMPT = [7, 8, 9]


def _stream(key: str) -> list[object]:
    return [
        _chunk([_c(0, {"role": "assistant", "content": ""})], prompt_token_ids=PROMPT),
        _chunk([_c(0, {key: "Two plus "}, [60, 61], [-0.1, -0.2])]),
        _chunk([_c(0, {key: "two is four."}, [62, 63], [-0.3, -0.4])]),
        _chunk([_c(0, {"content": "4"}, [70], [-0.05])]),
        _chunk([_c(0, {}, finish_reason="stop")]),
        "[DONE]",
    ]


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_streamed_thinking_lands_in_the_response_under_the_server_s_name(tmp_path: Path, key: str) -> None:
    frames = [cx.record("chat", REQUEST, cx.sse(_stream(key), named=False), stream=True, seq=0, call_id="c-r")]
    lake = cx.land_frames(tmp_path, frames, [{"rollout_id": "r0", "reward": 1.0}])
    assert cx.rejects(lake) == []
    (row,) = cx.calls(lake)
    message = json.loads(row["response"])["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "4", key: "Two plus two is four."}
    assert row["completion_token_ids"] == [60, 61, 62, 63, 70]
    assert row["completion_logprobs"] == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.05])
    assert row["prompt_token_ids"] == PROMPT and row["finish_reason"] == "stop"


def test_the_thinking_is_queryable_in_sql(tmp_path: Path) -> None:
    frames = [cx.record("chat", REQUEST, cx.sse(_stream("reasoning"), named=False), stream=True, seq=0, call_id="c-r")]
    lake = cx.land_frames(tmp_path, frames, [{"rollout_id": "r0", "reward": 1.0}])
    sql = "select response->>'$.choices[0].message.reasoning' as thinking from model_calls"
    assert run_sql(lake, sql).to_pylist() == [{"thinking": "Two plus two is four."}]


def test_the_stop_reason_vllm_streams_with_the_last_chunk_is_kept(tmp_path: Path) -> None:
    """vLLM names what ended a choice (a stop string, or a stop token's id) in ``stop_reason``."""
    events = [
        _chunk([_c(0, {"role": "assistant", "content": "4"}, [70], [-0.05])], prompt_token_ids=PROMPT),
        _chunk([_c(0, {}, finish_reason="stop", stop_reason="</answer>")]),
        "[DONE]",
    ]
    frames = [cx.record("chat", REQUEST, cx.sse(events, named=False), stream=True, seq=0, call_id="c-s")]
    lake = cx.land_frames(tmp_path, frames)
    (row,) = cx.calls(lake)
    choice = json.loads(row["response"])["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "</answer>")
