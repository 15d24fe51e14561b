"""Choices of one call whose server repeats an index (a gateway that makes n calls of one choice each answers
index 0 n times), landed from a real capture segment: each row of the call still has its own choice_index,
so the trees' call-to-path link and training's query (sql/train/sequences.sql) join every choice with its
own path and its own logprobs, once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from clawpipe import tables
from clawpipe.sqlfiles import sql_text
from clawpipe.trees import build_iteration
from tests.apis import captures as cx

PROMPT = [1, 2, 3]
ANSWERS = {0: ([5, 6], -0.25), 1: ([7, 8, 9], -0.75), 2: ([5, 6, 4], -1.5)}


def _choice(index: int | None, ids: list[int], lp: float) -> dict[str, Any]:
    c = {
        "message": {"role": "assistant", "content": "x"},
        "finish_reason": "stop",
        "token_ids": ids,
        "logprobs": {"content": [{"token": "t", "logprob": lp, "top_logprobs": []} for _ in ids]},
    }
    return c if index is None else {"index": index, **c}


@pytest.mark.parametrize("given", [[0, 0, 0], [1, 1, 0], [None, 0, None]], ids=["all-0", "repeated", "missing"])
def test_choices_with_a_repeated_index_each_train_their_own_tokens_once(tmp_path: Path, given: list) -> None:
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "m",
        "prompt_token_ids": PROMPT,
        "choices": [_choice(x, *ANSWERS[k]) for k, x in enumerate(given)],
    }
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 3}
    frame = cx.record("chat", request, json.dumps(body).encode(), stream=False, seq=0, call_id="c0")
    lake = cx.land_frames(tmp_path, [frame], [{"rollout_id": "r0", "reward": 1.0}])
    rows = cx.calls(lake)
    # each answer keeps its place as its index, the order the server listed them in
    assert [(r["choice_index"], r["completion_token_ids"]) for r in rows] == [(k, ANSWERS[k][0]) for k in range(3)]

    build_iteration(lake, cx.RUN, 0)
    con = tables.connect(lake)
    params = {"run_id": cx.RUN, "iteration": 0, "scope": "rollout", "include_retokenized": False}
    trained = con.sql(sql_text("train/sequences"), params=params).to_arrow_table().to_pylist()
    assert sorted(t["choice_index"] for t in trained) == [0, 1, 2]  # one row per choice
    nodes = {
        n["node_id"]: n
        for n in con.sql("select * from tree_nodes where tree_id = 'rollout:r0'").to_arrow_table().to_pylist()
    }
    for t in trained:
        ids, lp = ANSWERS[t["choice_index"]]
        assert t["completion_logprobs"] == pytest.approx([lp] * len(ids))
        path: list[int] = []  # the tokens from the root to the node where the choice's path ends
        v = t["node_id"]
        while v >= 0:
            path = nodes[v]["token_ids"] + path
            v = nodes[v]["parent_id"]
        assert path == PROMPT + ids
