"""vLLM completions with ``echo`` and ``prompt_logprobs``, landed from real capture segments. With ``echo`` the
engine's ``token_logprobs`` hold the prompt's logprobs first (the first one null) and then the sampled
tokens', while ``token_ids`` hold the sampled ids only: the lake keeps the sampled tokens' logprobs, the
call lands (it is no reject), and the tree trains the completion with them. ``prompt_logprobs`` (a list of
dicts beside the choice, its first entry null) changes nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from clawpipe.lake import openai_fast
from clawpipe.lake.parse import parse_response
from clawpipe.trees import build_iteration
from tests.apis import captures as cx
from tests.trees.fixtures import locate, read_tree

PROMPT = [11, 12, 13, 14]
IDS = [21, 22, 23]
PROMPT_LPS = [None, -1.0, -2.0, -3.0]  # what vLLM gives the prompt's tokens: the first has no logprob
SAMPLED_LPS = [-0.125, -0.25, -0.5]


def _logprobs(values: list[float | None]) -> dict[str, Any]:
    return {
        "tokens": [f"t{i}" for i in range(len(values))],
        "token_logprobs": values,
        "text_offset": list(range(len(values))),
        "top_logprobs": [None if v is None else {f"t{i}": v} for i, v in enumerate(values)],
    }


def _prompt_logprobs() -> list[dict[str, Any] | None]:
    return [None] + [
        {str(t): {"logprob": lp, "rank": 1, "decoded_token": "x"}}
        for t, lp in zip(PROMPT[1:], PROMPT_LPS[1:], strict=True)
    ]


def _body(ids: list[int] | None, lps: list[float | None], *, with_ids: bool = True, **choice: Any) -> bytes:
    c: dict[str, Any] = {"index": 0, "text": "abcd efg", "logprobs": _logprobs(lps), "finish_reason": "stop"}
    if with_ids:
        c |= {"prompt_token_ids": PROMPT, "token_ids": ids}
    usage = {"prompt_tokens": len(PROMPT), "completion_tokens": len(ids or ()), "total_tokens": 0}
    return json.dumps(
        {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [c | choice], "usage": usage}
    ).encode()


def _stream() -> bytes:
    """Streamed with echo: the first chunk carries the prompt's logprobs and the first sampled token's."""

    def chunk(lps: list[float | None], ids: list[int], **kw: Any) -> dict[str, Any]:
        c = {"index": 0, "text": "x", "logprobs": _logprobs(lps), "finish_reason": None, "token_ids": ids, **kw}
        return {"id": "cmpl-2", "object": "text_completion", "model": "m", "choices": [c]}

    events: list[Any] = [
        chunk([*PROMPT_LPS, SAMPLED_LPS[0]], IDS[:1], prompt_token_ids=PROMPT),
        chunk(SAMPLED_LPS[1:2], IDS[1:2]),
        chunk(SAMPLED_LPS[2:], IDS[2:], finish_reason="stop"),
        "[DONE]",
    ]
    return cx.sse(events, named=False)


ECHO = {"model": "m", "prompt": "abcd", "echo": True, "logprobs": 1}
CASES = {
    "echo": (ECHO, False, _body(IDS, [*PROMPT_LPS, *SAMPLED_LPS]), IDS, SAMPLED_LPS),
    "echo streamed": ({**ECHO, "stream": True}, True, _stream(), IDS, SAMPLED_LPS),
    "echo, nothing generated (scoring)": ({**ECHO, "max_tokens": 0}, False, _body([], PROMPT_LPS), [], []),
    "echo without ids": (ECHO, False, _body(IDS, [*PROMPT_LPS, *SAMPLED_LPS], with_ids=False), None, SAMPLED_LPS),
    "prompt_logprobs": (
        {"model": "m", "prompt": "abcd", "prompt_logprobs": 1, "logprobs": 1},
        False,
        _body(IDS, SAMPLED_LPS, prompt_logprobs=_prompt_logprobs()),
        IDS,
        SAMPLED_LPS,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_echoed_prompt_logprobs_stay_out_of_the_completion_s(tmp_path: Path, case: str) -> None:
    request, stream, body, ids, lps = CASES[case]
    frames = [cx.record("completions", request, body, stream=stream, seq=0, call_id="c0")]
    lake = cx.land_frames(tmp_path, frames, [{"rollout_id": "r0", "reward": 1.0}])
    assert cx.rejects(lake) == []
    (row,) = cx.calls(lake)
    assert row["completion_token_ids"] == ids
    assert row["completion_logprobs"] == pytest.approx(lps)
    if ids is not None:
        assert row["prompt_token_ids"] == PROMPT
    assert json.loads(row["response"])["choices"][0]["logprobs"]["token_logprobs"][0] == (
        None if "echo" in case else SAMPLED_LPS[0]
    )  # the response is kept as sent


def test_an_echoed_call_s_completion_is_trained_with_its_sampling_logprobs(tmp_path: Path) -> None:
    request, stream, body, _, _ = CASES["echo"]
    frames = [cx.record("completions", request, body, stream=stream, seq=0, call_id="c0")]
    lake = cx.land_frames(tmp_path, frames, [{"rollout_id": "r0", "reward": 1.0}])
    build_iteration(lake, cx.RUN, 0)
    nodes = read_tree(lake, cx.RUN, 0, "rollout:r0")
    path = locate(nodes, PROMPT + IDS)
    assert path is not None and [nodes[v]["generated"] for v in path] == [False, True]
    assert nodes[path[0]]["logprobs"] is None
    assert nodes[path[1]]["token_ids"] == IDS and nodes[path[1]]["logprobs"] == pytest.approx(SAMPLED_LPS)


@pytest.mark.parametrize("n_prompt", [4, 12_000], ids=["small", "large (prompt ids cut out before decoding)"])
@pytest.mark.parametrize("first", [None, -9.0], ids=["null first", "a number first"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled reader", "msgspec reader"])
def test_every_parse_path_drops_the_echoed_prompt_s_logprobs(
    n_prompt: int, first: float | None, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not compiled:
        monkeypatch.setattr(openai_fast, "_openai_scan", None)
    prompt = list(range(100, 100 + n_prompt))
    lps = [first, *([-1.0] * (n_prompt - 1)), *SAMPLED_LPS]
    choice = {"index": 0, "text": "x", "logprobs": _logprobs(lps), "finish_reason": "stop"}
    choice |= {"prompt_token_ids": prompt, "token_ids": IDS}
    body = {"id": "c", "object": "text_completion", "model": "m", "choices": [choice]}
    parsed = parse_response("completions", False, json.dumps(body).encode())
    (c,) = parsed.choices
    assert list(c.prompt_token_ids) == prompt and list(c.token_ids or ()) == IDS
    assert list(c.logprobs or ()) == SAMPLED_LPS
