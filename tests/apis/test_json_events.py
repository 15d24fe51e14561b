"""json_events: the JSON objects of a whole SSE body, as the proxy's retokenizer and the vLLM stream reader take
them; and that reader, now reassembling through clawpipe.apis, reads a stream cut short as far as it got."""

from __future__ import annotations

import json
from pathlib import Path

from clawpipe.apis import json_events, reassemble
from clawpipe.serving.vllm import parse_chat_response, parse_chat_stream

FIXTURES = Path(__file__).resolve().parent.parent / "serving" / "fixtures"


def test_json_events_keeps_objects_in_order_and_leaves_out_done_and_a_torn_tail() -> None:
    body = (
        b'data: {"a": 1}\n\n'
        b": keep-alive\n\n"
        b'data: {"b":\ndata: 2}\n\n'  # one event's data over two lines
        b"data: [1, 2]\n\n"  # JSON, but not an object
        b"data: [DONE]\n\n"
        b'data: {"c": '  # a torn last event
    )
    assert json_events(body) == [{"a": 1}, {"b": 2}]
    nested = b"data: " + b"[" * 200_000 + b"\n\n"  # deeper than the JSON parser recurses
    assert json_events(b'data: {"a": 1}\n\n' + nested + b'data: {"d": 4}\n\n') == [{"a": 1}, {"d": 4}]


def test_a_vllm_stream_cut_mid_event_reads_as_far_as_it_got() -> None:
    whole = (FIXTURES / "vllm_chat_stream.txt").read_bytes()
    prompt = [151644, 872, 198, 13048, 151645, 198, 151644, 77091, 198]
    full = parse_chat_stream(whole.decode().splitlines())
    assert full["prompt_token_ids"] == prompt
    (choice,) = full["choices"]
    assert (choice["token_ids"], choice["logprobs"]) == ([9707, 1052, 151645], [-0.31, -1.02, -0.05])
    assert (choice["text"], choice["finish_reason"]) == ("Hello there", "stop")
    cut = whole[: whole.index(b'"token_id:151645"')].decode().splitlines()  # inside the last token's event
    got = parse_chat_stream(cut)
    assert got["prompt_token_ids"] == prompt
    (choice,) = got["choices"]  # the two whole token events, nothing of the torn one
    assert (choice["token_ids"], choice["logprobs"]) == ([9707, 1052], [-0.31, -1.02])
    assert (choice["text"], choice["finish_reason"]) == ("Hello there", None)


def test_the_vllm_stream_reader_gives_what_the_unstreamed_reader_gives() -> None:
    lines = (FIXTURES / "vllm_chat_stream_tools.txt").read_text().splitlines()
    (choice,) = parse_chat_stream(lines)["choices"]
    body = reassemble("chat", json_events("\n".join(lines).encode()))
    assert choice == parse_chat_response(json.loads(json.dumps(body)))["choices"][0]
    assert choice["tool_calls"][0]["function"] == {"name": "shell", "arguments": '{"command": "ls"}'}
