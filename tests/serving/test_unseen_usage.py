"""Usage in streams as vLLM reports it: `stream_options.include_usage` ends the stream with a usage chunk
whose choices are empty (n choices counted together); `continuous_usage_stats` adds the running count to
every chunk."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.serving.calls import MSGS, stream_events

BODIES = {
    "/v1/chat/completions": {"messages": MSGS},
    "/v1/completions": {"prompt": "hi"},
}


@pytest.mark.parametrize("path", list(BODIES))
def test_continuous_usage_stats_count_the_ids_sent_so_far_in_every_chunk(server: Any, path: str) -> None:
    body = {
        "model": "tiny",
        **BODIES[path],
        "max_tokens": 6,
        "n": 2,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events = stream_events(httpx.post(f"{server.url}{path}", json=body, timeout=60).text)
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
    sent = 0
    prompt = last["usage"]["prompt_tokens"]
    for ev in chunks:
        sent += sum(len(ch.get("token_ids") or []) for ch in ev["choices"])
        if any(ch.get("token_ids") for ch in ev["choices"]):
            assert ev["usage"] == {"prompt_tokens": prompt, "completion_tokens": sent, "total_tokens": prompt + sent}
    assert sent == 12


@pytest.mark.parametrize("path", list(BODIES))
def test_include_usage_alone_puts_usage_only_in_the_last_chunk(server: Any, path: str) -> None:
    body = {"model": "tiny", **BODIES[path], "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    events = stream_events(httpx.post(f"{server.url}{path}", json=body, timeout=60).text)
    assert [("usage" in ev) for ev in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["choices"] == []
