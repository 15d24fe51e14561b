"""Sampling fields of the OpenAI, vLLM and Anthropic protocols beyond temperature and top-p: top_k, min_p,
min_tokens, presence / frequency / repetition penalties (applied to the distribution sampled from, checked
against a decode written out here), their ranges, and fields the engine does not know."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from clawpipe.serving.policy import load_model, load_tokenizer
from tests.serving.calls import MSGS, PATHS, error_message, post
from tests.serving.conftest import SECOND_TURN, TOOLS

HI = {"messages": MSGS, "max_tokens": 12}


def ids_of(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    body = r.json()
    return list(body["choices"][0]["token_ids"] if "choices" in body else body["token_ids"])


def reference_greedy(model_dir: Path, prompt: list[int], n: int, **pen: float) -> list[int]:
    """Greedy decoding by full forwards, the penalties applied as OpenAI and vLLM define them."""
    model = load_model(model_dir, "cpu")
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
            rep = pen.get("repetition", 1.0)
            for t in set(prompt + out) if rep != 1.0 else ():
                logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
            for t, c in Counter(out).items():
                logits[t] -= pen.get("frequency", 0.0) * c + pen.get("presence", 0.0)
            out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_top_k_one_samples_the_greedy_tokens_at_any_temperature(server: Any, api: str) -> None:
    greedy = ids_of(post(server, api, {**HI, "temperature": 0}))
    for seed in (1, 2, 3):
        assert ids_of(post(server, api, {**HI, "temperature": 1.5, "top_k": 1, "seed": seed})) == greedy
    # without top_k those seeds sample something else: the policy's distribution is not that sharp
    free = [ids_of(post(server, api, {**HI, "temperature": 1.5, "seed": seed})) for seed in (1, 2, 3)]
    assert any(ids != greedy for ids in free)


def test_top_k_keeps_the_reported_logprobs_the_policys_own(server: Any) -> None:
    """top_k shapes what is sampled from; the logprob reported stays log_softmax(logits / T), as vLLM reports it."""
    body = {**HI, "temperature": 1.0, "logprobs": True}
    greedy = post(server, "chat", {**body, "temperature": 0}).json()["choices"][0]
    top1 = post(server, "chat", {**body, "top_k": 1, "seed": 5}).json()["choices"][0]
    assert top1["token_ids"] == greedy["token_ids"]
    lp = [e["logprob"] for e in top1["logprobs"]["content"]]
    assert lp == pytest.approx([e["logprob"] for e in greedy["logprobs"]["content"]], abs=1e-5)
    assert all(x < -1e-3 for x in lp)  # not the 0.0 of a distribution cut to one token


def test_min_p_of_one_keeps_only_the_likeliest_token(server: Any) -> None:
    greedy = ids_of(post(server, "chat", {**HI, "temperature": 0}))
    assert ids_of(post(server, "chat", {**HI, "temperature": 1.5, "min_p": 1.0, "seed": 9})) == greedy


def test_min_tokens_holds_off_the_end_of_turn(server: Any, scripted_dir: Path) -> None:
    body = {"messages": SECOND_TURN, "tools": TOOLS, "temperature": 0, "max_tokens": 40}
    short = post(server, "chat", body).json()["choices"][0]
    assert short["finish_reason"] == "stop"
    n = len(short["token_ids"])  # the scripted answer, its end-of-turn id last
    eos = short["token_ids"][-1]
    longer = post(server, "chat", {**body, "min_tokens": n + 3, "max_tokens": n + 6}).json()["choices"][0]
    assert longer["token_ids"][: n - 1] == short["token_ids"][: n - 1]
    assert eos not in longer["token_ids"][: n + 3] and len(longer["token_ids"]) > n + 3, longer


@pytest.mark.parametrize(
    "pen",
    [{"frequency": 2.0}, {"presence": 2.0}, {"frequency": 1.5, "presence": 0.5}, {"repetition": 1.8}],
    ids=["frequency", "presence", "both", "repetition"],
)
def test_penalties_decode_as_the_reference_does(server: Any, scripted_dir: Path, pen: dict[str, float]) -> None:
    keys = {"frequency": "frequency_penalty", "presence": "presence_penalty", "repetition": "repetition_penalty"}
    pens = {keys[k]: v for k, v in pen.items()}
    body = {"messages": MSGS, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **pens}
    r = post(server, "chat", body)
    prompt = r.json()["prompt_token_ids"]
    assert ids_of(r) == reference_greedy(scripted_dir, prompt, 16, **pen)
    plain = ids_of(post(server, "chat", {**body, **{keys[k]: 0 if k != "repetition" else 1 for k in pen}}))
    assert plain == reference_greedy(scripted_dir, prompt, 16)
    assert plain != ids_of(r)  # the penalty changed what was generated


BAD = [
    ("chat", {"top_k": -2}, "top_k"),
    ("messages", {"top_k": -2}, "top_k"),
    ("chat", {"top_k": 1.5}, "'top_k' must be an integer"),
    ("chat", {"min_p": 1.5}, "min_p must be in [0, 1]"),
    ("chat", {"min_tokens": 50}, "min_tokens must be in [0, max_tokens = 12], got 50"),
    ("chat", {"repetition_penalty": 0}, "repetition_penalty must be in (0, 2]"),
    ("chat", {"top_logprobs": 21, "logprobs": True}, "top_logprobs must be in [0, 20], got 21"),
    ("chat", {"skip_special_tokens": "no"}, "'skip_special_tokens' must be true or false"),
]


@pytest.mark.parametrize(("api", "extra", "message"), BAD)
def test_out_of_range_sampling_values_are_a_400_naming_the_field(
    server: Any, api: str, extra: dict[str, Any], message: str
) -> None:
    r = post(server, api, {**HI, **extra})
    assert r.status_code == 400 and message in error_message(api, r), r.text
    if api == "chat" and "must be" in message and not message.startswith("'"):
        assert r.json()["error"]["param"] == next(iter(extra)), r.text


def test_vllms_minus_one_top_k_means_every_token(server: Any) -> None:
    same = {**HI, "temperature": 1.0, "seed": 11}
    assert ids_of(post(server, "chat", {**same, "top_k": -1})) == ids_of(post(server, "chat", same))


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_fields_the_engine_does_not_know_are_ignored_in_every_api(server: Any, api: str) -> None:
    """As vLLM's server does by default: an SDK newer than the engine still gets its answer."""
    body = {**HI, "max_output_tokens": 4, "input": "hi", "seed": 3, "temperature": 1.0}
    if api == "responses":
        body.pop("messages")
        body.pop("max_tokens")
    else:
        body.pop("input")
        body.pop("max_output_tokens")
    plain = httpx.post(f"{server.url}{PATHS[api]}", json={"model": "tiny", **body}, timeout=60)
    extra = httpx.post(
        f"{server.url}{PATHS[api]}",
        json={"model": "tiny", **body, "some_future_field": {"x": 1}, "verbosity": "low"},
        timeout=60,
    )
    assert plain.status_code == extra.status_code == 200, extra.text


def test_stop_token_ids_end_a_choice_with_the_id_kept_and_its_text_left_out(server: Any, scripted_dir: Path) -> None:
    tok = load_tokenizer(scripted_dir)
    body = {"messages": SECOND_TURN, "tools": TOOLS, "temperature": 0, "max_tokens": 40}
    ids = ids_of(post(server, "chat", body))
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i] and tok.decode(ids[i : i + 1]).strip())
    choice = post(server, "chat", {**body, "stop_token_ids": [ids[k]]}).json()["choices"][0]
    assert choice["token_ids"] == ids[: k + 1] and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == ids[k]  # vLLM's stop_reason: the id
    assert choice["message"]["content"] == tok.decode(ids[:k])
    # min_tokens holds a stop_token_ids id off as it holds EOS off
    held = post(server, "chat", {**body, "stop_token_ids": [ids[k]], "min_tokens": k + 2}).json()["choices"][0]
    assert held["token_ids"][:k] == ids[:k] and ids[k] not in held["token_ids"][: k + 2], held
    r = post(server, "chat", {**body, "stop_token_ids": [10**9]})
    assert r.status_code == 400 and "stop_token_ids must be in [0, " in error_message("chat", r)
    r = post(server, "chat", {**body, "stop_token_ids": "5"})
    assert r.status_code == 400 and "'stop_token_ids' must be a list of token ids" in error_message("chat", r)


VLLM_UNSUPPORTED = [
    ({"guided_json": {"type": "object"}}, "'guided_json' is not supported"),
    ({"guided_choice": ["a", "b"]}, "'guided_choice' is not supported"),
    ({"structured_outputs": {"regex": "a+"}}, "'structured_outputs' is not supported"),
    ({"use_beam_search": True}, "'use_beam_search' is not supported"),
    ({"best_of": 3}, "'best_of' must equal n (1)"),
    ({"prompt_logprobs": 1}, "'prompt_logprobs' is not supported"),
    ({"include_stop_str_in_output": True}, "'include_stop_str_in_output' is not supported"),
]


@pytest.mark.parametrize(("extra", "message"), VLLM_UNSUPPORTED)
def test_vllm_fields_whose_answer_the_engine_cannot_give_are_a_400(
    server: Any, extra: dict[str, Any], message: str
) -> None:
    r = post(server, "chat", {**HI, **extra})
    assert r.status_code == 400 and message in error_message("chat", r), r.text
    assert r.json()["error"]["param"] == next(iter(extra))


def test_neutral_values_of_those_vllm_fields_are_accepted(server: Any) -> None:
    neutral = {"use_beam_search": False, "best_of": 2, "n": 2, "include_stop_str_in_output": False}
    assert post(server, "chat", {**HI, **neutral}).status_code == 200


def test_max_completion_tokens_is_read_before_max_tokens(server: Any) -> None:
    base = {"messages": MSGS, "ignore_eos": True}
    assert len(ids_of(post(server, "chat", {**base, "max_completion_tokens": 3}))) == 3
    assert len(ids_of(post(server, "chat", {**base, "max_completion_tokens": 2, "max_tokens": 5}))) == 2
    r = post(server, "chat", {**base, "max_completion_tokens": "3"})
    assert r.status_code == 400 and "'max_completion_tokens' must be an integer" in error_message("chat", r)
