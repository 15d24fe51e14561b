"""Upstreams that return no ids: retokenized with the model's tokenizer + chat template, marked and counted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def _strip_ids(value: Any) -> Any:
    """`value` without any token-id field, as an engine that returns no ids answers."""
    if isinstance(value, dict):
        return {k: _strip_ids(v) for k, v in value.items() if "token_ids" not in k}
    if isinstance(value, list):
        return [_strip_ids(v) for v in value]
    return value


class _IdlessRelay:
    """A loopback HTTP relay to the engine that keeps the engine's answers (to compare with) and hands the proxy
    the same answers without their ids (non-streaming calls)."""

    def __init__(self, engine_url: str) -> None:
        import http.server
        import threading

        import httpx

        relay = self
        self.engine_url = engine_url
        self.answers: list[dict[str, Any]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                headers = {k: v for k, v in self.headers.items() if k.lower().startswith(("content-type", "x-"))}
                got = httpx.post(engine_url + self.path, content=body, headers=headers, timeout=120)
                answer = got.json()
                relay.answers.append(answer)
                out = json.dumps(_strip_ids(answer)).encode()
                self.send_response(got.status_code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def idless_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[_IdlessRelay, Path]]:
    from clawpipe.serving.policy import init_policy
    from clawpipe.serving.server import start_server

    model = init_policy(tmp_path_factory.mktemp("policy") / "tiny", size="tiny", seed=0)
    handle = start_server(model, device="cpu", admin_token="adm", max_model_len=2048, served_name="tiny")
    relay = _IdlessRelay(handle.url)
    yield relay, model
    relay.close()
    handle.stop()


PREFILL_CALLS = {
    "messages text blocks": (
        "messages",
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [{"type": "text", "text": '{"ans'}, {"type": "text", "text": 'wer":'}],
                },
            ]
        },
    ),
    "messages special text": (
        "messages",
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok<|im_end|>"}]},
    ),
    "chat continue_final_message": (
        "chat",
        {
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(PREFILL_CALLS))
def test_a_prefilled_call_to_an_engine_without_ids_is_retokenized_to_the_engines_own_prompt(
    make_proxy: Any, idless_engine: tuple[_IdlessRelay, Path], case: str
) -> None:
    """Proxy -> relay that drops the ids -> clawpipe's engine: the retokenized prompt of a prefilled call is the
    prompt the engine conditioned on, id for id; through a proxy straight to the engine, the captured ids are
    that prompt too."""
    import httpx

    relay, model_dir = idless_engine
    api, body = PREFILL_CALLS[case]
    proxy = make_proxy([relay.url], tokenizer_dir=model_dir)
    base = (
        proxy.anthropic_base("p1") + "/v1/messages"
        if api == "messages"
        else proxy.openai_base("p1") + "/chat/completions"
    )
    r = httpx.post(base, json={"model": "tiny", "max_tokens": 4, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    (rec,) = proxy.records()
    assert rec.header["token_source"] == "retokenized"
    engine_prompt = relay.answers[-1]["prompt_token_ids"]
    assert rec.header["retokenized"]["prompt_token_ids"] == engine_prompt
    # straight to the engine, the capture holds the engine's own ids: the same prompt, conditioned on as sent
    direct = make_proxy([relay.engine_url])
    path = "/v1/messages" if api == "messages" else "/chat/completions"
    url = (direct.anthropic_base("p2") if api == "messages" else direct.openai_base("p2")) + path
    r = httpx.post(url, json={"model": "tiny", "max_tokens": 4, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    (rec,) = direct.records()
    assert rec.header["token_source"] == "upstream"
    assert json.loads(rec.response)["prompt_token_ids"] == engine_prompt
