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


def test_a_vllm_stream_cut_mid_event_reads_as_far_as_it_got() -> None:
    whole = (FIXTURES / "vllm_chat_stream.txt").read_bytes()
    events = json_events(whole)
    last = whole.rindex(b"data: {")  # cut inside the last JSON event
    cut = whole[: last + 40].decode().splitlines()
    got = parse_chat_stream(cut)
    want = parse_chat_response(reassemble("chat", events[:-1]))
    assert got == want and got["choices"][0]["token_ids"]
    assert parse_chat_stream(whole.decode().splitlines()) == parse_chat_response(reassemble("chat", events))


def test_the_vllm_stream_reader_gives_what_the_unstreamed_reader_gives() -> None:
    lines = (FIXTURES / "vllm_chat_stream_tools.txt").read_text().splitlines()
    (choice,) = parse_chat_stream(lines)["choices"]
    body = reassemble("chat", json_events("\n".join(lines).encode()))
    assert choice == parse_chat_response(json.loads(json.dumps(body)))["choices"][0]
    assert choice["tool_calls"][0]["function"] == {"name": "shell", "arguments": '{"command": "ls"}'}
