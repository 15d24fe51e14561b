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
