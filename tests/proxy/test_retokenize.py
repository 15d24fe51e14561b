"""Upstreams that return no ids: retokenized with the model's tokenizer + chat template, marked and counted."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from clawpipe.proxy.retokenize import Retokenizer
from tests.support.upstream import ScriptedUpstream, say, tool_call

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world the weather is sunny in paris"] * 50, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return d


def test_no_ids_upstream_is_retokenized_and_marked(make_proxy, model_dir: Path):
    with ScriptedUpstream([say("sunny in paris"), tool_call("f", {"a": 1}), say("hello")], ids=False) as up:
        proxy = make_proxy([up.url], tokenizer_dir=model_dir)
        client = openai.OpenAI(base_url=proxy.openai_base("r1"), api_key="x", max_retries=0)
        msgs = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hello world"}]
        assert client.chat.completions.create(model="m", messages=msgs).choices[0].message.content == "sunny in paris"
        stream = client.chat.completions.create(model="m", messages=msgs, stream=True)
        assert [c for c in stream]
        anthropic.Anthropic(base_url=proxy.anthropic_base("r1"), api_key="x", max_retries=0).messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "hello world"}]
        )
    recs = proxy.records()
    assert [r.header["token_source"] for r in recs] == ["retokenized"] * 3
    assert proxy.server.stats["retokenized"] == 3
    retok = Retokenizer(model_dir)
    expected_prompt = retok.encode(
        "<|im_start|>system\nbe nice<|im_end|>\n<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    )
    first = recs[0].header["retokenized"]
    assert first["prompt_token_ids"] == expected_prompt
    assert first["choices"] == [{"token_ids": retok.encode("sunny in paris<|im_end|>")}]
    second = recs[1].header["retokenized"]["choices"][0]["token_ids"]
    assert retok.tokenizer.decode(second, skip_special_tokens=False).startswith('<tool_call>{"name": "f"')
    assert recs[2].header["retokenized"]["prompt_token_ids"] == retok.encode(
        "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    )


def test_no_ids_and_no_tokenizer_is_marked_none_and_counted(make_proxy):
    with ScriptedUpstream(ids=False) as up:
        proxy = make_proxy([up.url])
        openai.OpenAI(base_url=proxy.openai_base("r1"), api_key="x", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}]
        )
    (rec,) = proxy.records()
    assert rec.header["token_source"] == "none" and rec.header["retokenized"] is None
    assert proxy.server.stats["no_ids"] == 1


@pytest.mark.slow
def test_retokenizer_matches_the_served_policys_chat_template(tmp_path: Path):
    """The proxy's template rendering (jinja2 + tokenizers) gives the ids transformers gives (docs/ARCHITECTURE.md,
    contract F)."""
    from clawpipe.serving.policy import init_policy, load_tokenizer

    d = init_policy(tmp_path / "policy", size="tiny")
    retok, tok = Retokenizer(d), load_tokenizer(d)
    msgs = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "what is 2+2? answer briefly"}]
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    for t in (None, tools):
        ours = retok.encode(retok.render(msgs, t, generation_prompt=True))
        theirs = tok.apply_chat_template(msgs, tools=t, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ours == theirs


@pytest.mark.parametrize(
    "prefill", ['{"answer": ', "The weather in", "", "<|im_end|>", "ok<|im_end|>\n<|im_start|>user"]
)
def test_an_open_final_turn_is_retokenized_as_the_engine_renders_it(tmp_path: Path, prefill: str):
    """An Anthropic prefill (or chat's continue_final_message) ends the prompt in the open assistant turn,
    its body encoded on its own, exactly as the engine's renderer gives it; no end-of-turn after it, and
    special-token strings in the prefill spelt as text there too."""
    from clawpipe.proxy.retokenize import prompt_ending
    from clawpipe.serving.policy import init_policy, load_tokenizer
    from clawpipe.serving.splice import render_open

    d = init_policy(tmp_path / "policy", size="tiny")
    retok, tok = Retokenizer(d), load_tokenizer(d)
    msgs = [{"role": "user", "content": "weather in paris? reply in json"}, {"role": "assistant", "content": prefill}]
    engine = render_open(tok, msgs, None, {}, set(), "continue")
    assert engine is not None
    ours = retok.open_turn(msgs, None)
    assert ours == list(engine)
    closed = retok.encode(retok.render(msgs, None, generation_prompt=False))
    assert ours != closed  # the old rendering closed the prefill's turn
    assert prompt_ending("messages", {}, msgs) == "continue"
    assert prompt_ending("chat", {"continue_final_message": True, "add_generation_prompt": False}, msgs) == "continue"
    assert prompt_ending("chat", {"add_generation_prompt": False}, msgs[:1]) == "none"
    assert prompt_ending("chat", {}, msgs) == "generate"


def test_a_prefilled_messages_call_from_an_upstream_without_ids_is_retokenized_open(make_proxy, model_dir: Path):
    """Through the proxy: the retokenized prompt of a prefilled call is the open turn, the prefill's ids last."""
    with ScriptedUpstream([say("sunny")], ids=False) as up:
        h = make_proxy([up.url], tokenizer_dir=model_dir)
        client = anthropic.Anthropic(base_url=h.anthropic_base("r1"), api_key="x", max_retries=0)
        user = {"role": "user", "content": "the weather in paris"}
        client.messages.create(model="m", max_tokens=8, messages=[user, {"role": "assistant", "content": "the"}])
    (rec,) = h.records()
    retok = Retokenizer(model_dir)
    head = retok.encode("<|im_start|>user\nthe weather in paris<|im_end|>\n<|im_start|>assistant\n")
    assert rec.header["retokenized"]["prompt_token_ids"] == head + retok.encode("the")
