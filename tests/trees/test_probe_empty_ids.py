"""Empty id lists, landed from a real capture segment: a completion whose engine reported an empty prompt id
list is kept out of the trees and counted (trained from the root it would be a sample from no prompt), and
an ok call whose completion is empty adds its prompt as context, trains nothing and is not failed."""

from __future__ import annotations

import json
from pathlib import Path

from clawpipe import tables
from clawpipe.sqlfiles import sql_text
from clawpipe.trees import build_iteration
from tests.apis import captures as cx
from tests.trees.fixtures import read_stats, read_tree

PROMPT = [11, 12, 13]


def _chat(prompt: list[int], ids: list[int], finish: str = "stop") -> bytes:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "x" if ids else ""},
        "finish_reason": finish,
        "token_ids": ids,
        "logprobs": {"content": [{"token": "t", "logprob": -0.5, "top_logprobs": []} for _ in ids]},
    }
    body = {"id": "chatcmpl-1", "object": "chat.completion", "model": "m", "prompt_token_ids": prompt}
    return json.dumps({**body, "choices": [choice]}).encode()


def test_a_completion_after_an_empty_prompt_id_list_is_kept_out_and_counted(tmp_path: Path) -> None:
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    frames = [
        cx.record("chat", request, _chat(PROMPT, [5, 6]), stream=False, seq=0, call_id="whole"),
        cx.record("chat", request, _chat([], [7, 8]), stream=False, seq=1, call_id="no-prompt"),
        cx.record("chat", request, _chat([*PROMPT, 5, 6, 14], []), stream=False, seq=2, call_id="empty"),
    ]
    lake = cx.land_frames(tmp_path, frames, [{"rollout_id": "r0", "reward": 1.0}])
    assert [c["prompt_token_ids"] for c in cx.calls(lake)] == [PROMPT, [], [*PROMPT, 5, 6, 14]]
    summary = build_iteration(lake, cx.RUN, 0)

    assert (summary.kept_out_no_ids, summary.failed_calls, summary.n_calls) == (1, 0, 3)
    stats = read_stats(lake, cx.RUN, 0)["rollout:r0"]
    assert (stats["kept_out_no_ids"], stats["n_seqs"]) == (1, 2)
    nodes = read_tree(lake, cx.RUN, 0, "rollout:r0")
    generated = [(n["call_id"], n["token_ids"]) for n in nodes if n["generated"]]
    assert generated == [("whole", [5, 6])]  # [7, 8] is nowhere: not a root, not generated
    assert [n["token_ids"] for n in nodes if n["parent_id"] == -1] == [PROMPT]

    con = tables.connect(lake)
    links = con.sql("select call_id, n_generated from tree_sequences where scope = 'rollout' order by call_id")
    assert links.fetchall() == [("empty", 0), ("whole", 2)]
    params = {"run_id": cx.RUN, "iteration": 0, "scope": "rollout", "include_retokenized": False}
    trained = con.sql(sql_text("train/sequences"), params=params).to_arrow_table().to_pylist()
    # training finds no place in the trees for the call without a prompt: it is left out, never trained
    assert {t["call_id"]: t["node_id"] for t in trained} == {"whole": 1, "no-prompt": None}
