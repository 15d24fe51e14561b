"""The proxy in front of clawpipe's own serving engine (tiny policy): ids come from the sampler, not re-encoded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from clawpipe.proxy.retokenize import Retokenizer


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    from clawpipe.serving.policy import init_policy
    from clawpipe.serving.server import start_server

    model = init_policy(tmp_path_factory.mktemp("policy") / "tiny", size="tiny", seed=0)
    handle = start_server(model, device="cpu", admin_token="adm", max_model_len=2048, served_name="tiny")
    yield handle, model
    handle.stop()


@pytest.mark.slow
def test_engine_calls_are_captured_with_sampled_ids(make_proxy, engine):
    handle, model_dir = engine
    proxy = make_proxy([handle.url])
    msgs = [{"role": "user", "content": "Say hello."}]
    client = openai.OpenAI(base_url=proxy.openai_base("e1"), api_key="x", max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=1.0)
    chunks = list(
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=1.0, stream=True)
    )
    assert r.choices[0].finish_reason in ("stop", "length") and chunks
    anthropic.Anthropic(base_url=proxy.anthropic_base("e1"), api_key="x", max_retries=0).messages.create(
        model="tiny", max_tokens=8, messages=msgs
    )
    client.responses.create(model="tiny", input="Say hello.", max_output_tokens=8)
    recs = proxy.records()
    assert [x.header["api"] for x in recs] == ["chat", "chat", "messages", "responses"]
    assert all(x.header["token_source"] == "upstream" and x.header["status"] == "ok" for x in recs)
    body = json.loads(recs[0].response)
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) == r.usage.completion_tokens
    retok = Retokenizer(model_dir)
    assert body["prompt_token_ids"] == retok.encode(retok.render(msgs, None, generation_prompt=True))


@pytest.mark.slow
def test_count_tokens_goes_through_and_lands_outside_training(make_proxy, engine, tmp_path):
    """The Anthropic SDK's token counting (plain, beta, with ``?beta=true``) through the proxy to the engine:
    attributed by key, captured as api ``count_tokens`` with token_source ``none``, and landed as a row the
    tree builder keeps out (no token ids)."""
    from clawpipe.lake import land, run_sql

    handle, _ = engine
    proxy = make_proxy([handle.url])
    msgs = [{"role": "user", "content": "Count these tokens, please."}]
    client = anthropic.Anthropic(base_url=proxy.anthropic_base("ct"), api_key="x", max_retries=0)
    plain = client.messages.count_tokens(model="tiny", messages=msgs)
    beta = client.beta.messages.count_tokens(model="tiny", messages=msgs)
    query = client.messages.count_tokens(model="tiny", messages=msgs, extra_query={"beta": "true"})
    direct = anthropic.Anthropic(base_url=handle.url, api_key="x", max_retries=0).messages.count_tokens(
        model="tiny", messages=msgs
    )
    assert plain.input_tokens == beta.input_tokens == query.input_tokens == direct.input_tokens > 0
    client.messages.create(model="tiny", max_tokens=4, messages=msgs)
    recs = proxy.records()
    assert [(r.header["api"], r.header["query"]) for r in recs] == [
        ("count_tokens", ""),
        ("count_tokens", ""),
        ("count_tokens", "beta=true"),
        ("messages", ""),
    ]
    for rec in recs[:3]:
        h = rec.header
        assert (h["rollout_id"], h["status"], h["http_status"], h["token_source"]) == ("ct", "ok", 200, "none")
        assert h["request_changes"] == {}  # forwarded as sent: no token ids asked for
        assert json.loads(rec.response) == {"input_tokens": plain.input_tokens}
    report = land(proxy.capture_dir, tmp_path / "lake")
    assert report.rejects == 0
    rows = run_sql(
        tmp_path / "lake",
        "select api, token_source, prompt_token_ids is null as no_ids from model_calls order by seq",
    ).to_pylist()
    assert rows == [
        *[{"api": "count_tokens", "token_source": "none", "no_ids": True}] * 3,
        {"api": "messages", "token_source": "upstream", "no_ids": False},
    ]
