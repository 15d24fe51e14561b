"""The proxy names each call's rollout to the engine (``x-clawpipe-rollout``; a client's header of that name is
never forwarded), so the engine carries its own sampled ids into the rollout's next prompts: captured, landed
as ``spliced_tokens`` and seen by the trees as a chain without drift."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.proxy.conftest import ProxyHandle
from tests.support.upstream import ScriptedUpstream, say


def test_forwarded_calls_name_their_rollout_and_a_client_header_is_dropped(
    proxy: ProxyHandle, upstream: ScriptedUpstream
) -> None:
    upstream.push(say("hi"), say("hi"))
    for rollout in ("r1", "r/2 x"):
        client = openai.OpenAI(base_url=proxy.openai_base("r1"), api_key="x", max_retries=0)
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hello"}],
            extra_headers={"x-clawpipe-rollout": f"run1/0/{rollout}"},  # forged: another rollout's name
        )
    seen = [r.headers.get("x-clawpipe-rollout") for r in upstream.requests]
    assert seen == ["run1/0/r1", "run1/0/r1"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from clawpipe.serving.policy import init_policy
    from clawpipe.serving.server import start_server

    model = init_policy(tmp_path_factory.mktemp("policy") / "tiny", size="tiny", seed=0)
    handle = start_server(model, device="cpu", admin_token="adm", max_model_len=2048, served_name="tiny")
    yield handle
    handle.stop()


def _chat_loop(client: openai.OpenAI, turns: int, forged: str | None = None) -> list[Any]:
    """An append-only chat loop like harnesses/chat-loop, streamed every other turn."""
    messages: list[Any] = [{"role": "user", "content": "Guess my number."}]
    replies = []
    for k in range(turns):
        extra = {"x-clawpipe-rollout": forged} if forged else None
        kw: dict[str, Any] = {"model": "tiny", "max_tokens": 10, "seed": k, "extra_headers": extra}
        if k % 2:
            text = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(messages=messages, stream=True, **kw)
                if c.choices
            )
        else:
            text = client.chat.completions.create(messages=messages, **kw).choices[0].message.content or ""
        replies.append(text)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Higher."}]
    return replies


@pytest.mark.slow
def test_append_only_rollout_lands_without_drift(make_proxy: Any, engine: Any, tmp_path: Path) -> None:
    """Three turns of an append-only rollout with the untrained tiny policy through the proxy: each prompt holds
    the ids sampled before it (spliced_tokens in the response, the lake and tree_stats) and the rollout's tree
    has no drift branch. The same history under another rollout's key, with the first rollout's name forged in
    the header, is re-encoded: its prompt is not the sampled chain."""
    from clawpipe.lake import land, run_sql
    from clawpipe.trees import build_trees

    proxy = make_proxy([engine.url])
    replies = _chat_loop(openai.OpenAI(base_url=proxy.openai_base("loop"), api_key="x", max_retries=0), 3)
    other = openai.OpenAI(base_url=proxy.openai_base("other"), api_key="x", max_retries=0)
    history = [
        {"role": "user", "content": "Guess my number."},
        {"role": "assistant", "content": replies[0]},
        {"role": "user", "content": "Higher."},
    ]
    other.chat.completions.create(
        model="tiny", messages=history, max_tokens=2, extra_headers={"x-clawpipe-rollout": "run1/0/loop"}
    )
    (forged,) = [json.loads(r.response) for r in proxy.records() if r.header["rollout_id"] == "other"]
    assert forged["spliced_tokens"] == 0
    lake = tmp_path / "lake"
    assert land(proxy.capture_dir, lake).rejects == 0
    rows = run_sql(
        lake,
        "select rollout_id, seq, spliced_tokens, prompt_token_ids, completion_token_ids from model_calls "
        "order by rollout_id, seq",
    ).to_pylist()
    loop = [r for r in rows if r["rollout_id"] == "loop"]
    assert len(loop) == 3 and loop[0]["spliced_tokens"] == 0
    carried = 0
    for prev, cur in itertools.pairwise(loop):
        chain = prev["prompt_token_ids"] + prev["completion_token_ids"]
        assert cur["prompt_token_ids"][: len(chain)] == chain
        carried += len(prev["completion_token_ids"])
        assert cur["spliced_tokens"] == carried
    (again,) = [r for r in rows if r["rollout_id"] == "other"]
    assert again["prompt_token_ids"][: len(loop[1]["prompt_token_ids"])] != loop[1]["prompt_token_ids"]
    (summary,) = build_trees(lake, "run1", 0)
    stats = run_sql(
        lake, "select rollout_id, branches_drift, spliced_tokens from tree_stats where scope = 'rollout'"
    ).to_pylist()
    by_rollout = {s["rollout_id"]: s for s in stats}
    assert by_rollout["loop"]["branches_drift"] == 0
    assert by_rollout["loop"]["spliced_tokens"] == sum(r["spliced_tokens"] for r in loop) > 0
    assert summary.spliced_tokens == by_rollout["loop"]["spliced_tokens"]
