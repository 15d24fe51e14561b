"""The engine's API boundary under unusual clients: sampling values at their edges, content a text-only model
cannot read, malformed shapes the shared conversion does not catch, what the engine cannot honour. Each gets a
200 with valid JSON or a 400 in the API's own error shape naming the field, never a 500."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.serving.calls import MSGS, PATHS, error_message, post, stream_events, strict
from tests.serving.conftest import TOOLS


@pytest.mark.parametrize("temperature", [1e-40, 1e-44, 1e-300])
def test_a_temperature_next_to_zero_decodes_greedily_with_finite_logprobs(server: Any, temperature: float) -> None:
    greedy = post(server, "chat", {"messages": MSGS, "max_tokens": 4, "temperature": 0, "logprobs": True}).json()
    body = {"messages": MSGS, "max_tokens": 4, "temperature": temperature, "logprobs": True, "top_logprobs": 2}
    r = post(server, "chat", body)
    assert r.status_code == 200, r.text
    choice = strict(r.text)["choices"][0]
    assert choice["token_ids"] == greedy["choices"][0]["token_ids"]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(
        [e["logprob"] for e in greedy["choices"][0]["logprobs"]["content"]]
    )
    streamed = stream_events(post(server, "chat", {**body, "stream": True}).text)
    ids = [i for e in streamed for c in e["choices"] for i in c.get("token_ids", [])]
    assert ids == choice["token_ids"]
    legacy = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 3, "temperature": temperature, "logprobs": 2},
        timeout=60,
    )
    assert legacy.status_code == 200 and strict(legacy.text)["choices"][0]["token_ids"], legacy.text
    for api, extra in (("responses", {"input": "hi", "max_output_tokens": 3}), ("messages", {"max_tokens": 3})):
        r = post(server, api, {"messages": MSGS, **extra, "temperature": temperature})
        assert r.status_code == 200, (api, r.text)
        strict(r.text)


def test_a_chat_tool_choice_whose_function_is_not_an_object_is_a_400(server: Any) -> None:
    for function in ("guess", ["guess"], 3):
        choice = {"type": "function", "function": function}
        r = post(server, "chat", {"messages": MSGS, "max_tokens": 2, "tools": TOOLS, "tool_choice": choice})
        assert r.status_code == 400, r.text
        assert "function: {name: ...}" in error_message("chat", r) and r.json()["error"]["param"] == "tool_choice"
    named = {"type": "function", "function": {"name": "guess"}}
    assert post(server, "chat", {"messages": MSGS, "max_tokens": 2, "tools": TOOLS, "tool_choice": named}).is_success


@pytest.mark.parametrize("role", [["user"], {"type": "user"}, 5])
def test_a_message_role_that_is_not_a_string_is_a_400_naming_the_message(server: Any, role: Any) -> None:
    messages = [{"role": "system", "content": "s"}, {"role": role, "content": "hi"}]
    r = post(server, "chat", {"messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and "messages[1].role" in error_message("chat", r), r.text
    r = post(server, "messages", {"messages": messages[1:], "max_tokens": 2})
    assert r.status_code == 400 and "messages[0]" in error_message("messages", r), r.text


IMAGE_URL = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
ANTHROPIC_IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
MEDIA_CASES = [
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "what"}, IMAGE_URL]}]}, "[1]"),
    ("chat", {"messages": [{"role": "user", "content": [AUDIO]}]}, "messages[0].content[0]"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}]}, "'file'"),
    (
        "responses",
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]},
        "input[0].content[0]",
    ),
    (
        "responses",
        {
            "input": [
                {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file", "file_id": "f"}]}
            ]
        },
        "input[0].output[0]",
    ),
    ("messages", {"messages": [{"role": "user", "content": [ANTHROPIC_IMAGE]}]}, "messages[0].content[0]"),
    (
        "messages",
        {
            "messages": [
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [ANTHROPIC_IMAGE]}]}
            ]
        },
        "messages[0].content[0].content[0]",
    ),
]


@pytest.mark.parametrize(("api", "body", "where"), MEDIA_CASES)
def test_content_a_text_only_model_cannot_read_is_a_400_not_silently_dropped(
    server: Any, api: str, body: dict[str, Any], where: str
) -> None:
    r = post(server, api, {**body, "max_tokens": 2, "max_output_tokens": 2})
    assert r.status_code == 400, r.text
    message = error_message(api, r)
    assert where in message and "reads text only" in message


def test_a_text_part_without_string_text_is_a_400(server: Any) -> None:
    for text in (5, None, ["x"]):
        messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
        r = post(server, "chat", {"messages": messages, "max_tokens": 2})
        assert r.status_code == 400 and "messages[0].content[0]" in error_message("chat", r), r.text
    blocks = [{"role": "user", "content": [{"type": "input_text", "text": {"a": 1}}]}]
    r = post(server, "responses", {"input": blocks, "max_output_tokens": 2})
    assert r.status_code == 400 and "needs a string 'text'" in error_message("responses", r), r.text
    system = [{"type": "text", "text": 7}]
    r = post(server, "messages", {"messages": MSGS, "system": system, "max_tokens": 2})
    assert r.status_code == 400 and "system[0]" in error_message("messages", r), r.text


def test_stream_options_without_stream_is_a_400_as_openai_answers_it(server: Any) -> None:
    opts = {"include_usage": True}
    r = post(server, "chat", {"messages": MSGS, "max_tokens": 2, "stream_options": opts})
    assert r.status_code == 400 and "only allowed when 'stream' is true" in error_message("chat", r), r.text
    legacy = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream_options": opts}, timeout=30
    )
    assert legacy.status_code == 400 and legacy.json()["error"]["param"] == "stream_options", legacy.text
    # ignore_eos: end-of-turn drawn first (sampled at temperature 1) would end the answer at one token
    body = {"messages": MSGS, "max_tokens": 2, "stream": True, "stream_options": opts, "ignore_eos": True}
    streamed = stream_events(post(server, "chat", body).text)
    assert streamed[-1]["usage"]["completion_tokens"] == 2


def test_top_logprobs_without_logprobs_is_a_400(server: Any) -> None:
    r = post(server, "chat", {"messages": MSGS, "max_tokens": 2, "top_logprobs": 3})
    assert r.status_code == 400 and "'top_logprobs' needs 'logprobs': true" in error_message("chat", r), r.text
    # ignore_eos: end-of-turn drawn first (sampled at temperature 1) would end the answer at one token
    ok = post(
        server, "chat", {"messages": MSGS, "max_tokens": 2, "top_logprobs": 3, "logprobs": True, "ignore_eos": True}
    )
    assert [len(e["top_logprobs"]) for e in ok.json()["choices"][0]["logprobs"]["content"]] == [3, 3]


def test_an_anthropic_message_without_max_tokens_is_a_400_as_the_messages_api_answers_it(server: Any) -> None:
    for body in ({"messages": MSGS}, {"messages": MSGS, "max_tokens": None, "stream": True}):
        r = post(server, "messages", body)
        assert r.status_code == 400 and error_message("messages", r).startswith("max_tokens: Field required"), r.text
    counted = httpx.post(f"{server.url}/v1/messages/count_tokens", json={"model": "tiny", "messages": MSGS})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0  # counting needs no max_tokens


SCHEMA = {"name": "answer", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}
UNSUPPORTED = [
    ("chat", {"logit_bias": {"99999999": 100}}, "'logit_bias' is not supported"),
    ("chat", {"logit_bias": [1, 2]}, "'logit_bias' must be an object"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": SCHEMA}}, "'response_format' of type"),
    ("chat", {"response_format": {"type": "json_object"}}, "no constrained decoding"),
    ("chat", {"presence_penalty": 5}, "'presence_penalty' must be in [-2, 2], got 5"),
    ("chat", {"frequency_penalty": "x"}, "'frequency_penalty' must be a number"),
    ("responses", {"text": {"format": {"type": "json_schema", **SCHEMA}}}, "'text.format' of type"),
    ("completions", {"logit_bias": {"5": -100}}, "'logit_bias' is not supported"),
]


@pytest.mark.parametrize(("api", "extra", "message"), UNSUPPORTED)
def test_sampling_the_engine_cannot_honour_is_a_400_not_silently_ignored(
    server: Any, api: str, extra: dict[str, Any], message: str
) -> None:
    body = {"model": "tiny", "max_tokens": 2, "max_output_tokens": 2, **extra}
    body |= {"prompt": "hi"} if api == "completions" else {"messages": MSGS, "input": "hi"}
    path = {**PATHS, "completions": "/v1/completions"}[api]
    r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == next(iter(extra)) + (".format" if api == "responses" else "")


def test_neutral_values_of_unsupported_sampling_fields_are_accepted(server: Any) -> None:
    neutral = {"logit_bias": {}, "response_format": {"type": "text"}, "presence_penalty": 0, "frequency_penalty": 1.5}
    # min_tokens: sampled at temperature 1, end-of-turn could otherwise come first and end the answer at one token
    r = post(server, "chat", {"messages": MSGS, "max_tokens": 2, "min_tokens": 2, **neutral})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2, r.text
    r = post(server, "responses", {"input": "hi", "max_output_tokens": 2, "text": {"format": {"type": "text"}}})
    assert r.status_code == 200 and r.json()["text"] == {"format": {"type": "text"}}, r.text


def test_legacy_echo_and_suffix_are_a_400_not_silently_ignored(server: Any) -> None:
    url = f"{server.url}/v1/completions"
    for extra, message in (({"echo": True}, "'echo' is not supported"), ({"suffix": "}"}, "'suffix' (insertion)")):
        r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2, **extra}, timeout=30)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "echo": False, "suffix": ""}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None


def test_more_stop_strings_than_the_engine_searches_per_token_is_a_400(server: Any) -> None:
    many = [f"zq{i:06d}" for i in range(100_000)]  # each would be searched after every token, for every request
    r = post(server, "chat", {"messages": MSGS, "max_tokens": 2, "stop": many})
    assert r.status_code == 400 and "'stop' has 100000 strings; send at most 64" in error_message("chat", r), r.text
    r = post(server, "messages", {"messages": MSGS, "max_tokens": 2, "stop_sequences": many[:65]})
    assert r.status_code == 400 and "'stop_sequences' has 65 strings" in error_message("messages", r), r.text
    r = post(server, "chat", {"messages": MSGS, "max_tokens": 2, "stop": many[:64]})
    assert r.status_code == 200, r.text
