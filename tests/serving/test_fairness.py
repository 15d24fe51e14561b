"""Engine fairness: a long prompt is prefilled in chunks between decode steps, so a short request sent while it
runs is not held for the whole prefill; prompts past the per-request limit get a clear 400."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from clawpipe.serving.engine import Engine, SamplingParams, generate

LONG = 24_000  # prompt tokens: a whole-prompt prefill of the tiny policy takes ~1-2 s on one CPU thread


def _long_prompt(engine: Engine) -> list[int]:
    words = engine.tokenizer.encode("read the file, run the tests and fix what fails. ", add_special_tokens=False)
    return (words * (LONG // len(words) + 1))[:LONG]


async def _short_behind_long(engine: Engine, long_prompt: list[int]) -> dict[str, Any]:
    """Send the long request, then (once the engine has started on it) a short one; time both."""
    short_prompt = engine.tokenizer.encode("hi", add_special_tokens=False)
    t0 = time.monotonic()
    long_task = asyncio.ensure_future(
        generate(engine, long_prompt, SamplingParams(temperature=1.0, max_tokens=8, seed=3))
    )
    await asyncio.sleep(0.2)  # the long request is admitted at once and its prefill runs (~1 s or more)
    assert engine.load()["waiting"] == 0 and not long_task.done()
    t_short = time.monotonic()
    _, (short,) = await generate(engine, short_prompt, SamplingParams(temperature=0, max_tokens=4))
    short_done = time.monotonic()
    _, (long,) = await long_task
    long_done = time.monotonic()
    return {
        "short_wait_s": short_done - t_short,
        "long_s": long_done - t0,
        "short_first": short_done < long_done,
        "short": short,
        "long": long,
    }


@pytest.mark.slow
def test_a_short_request_is_not_held_behind_a_long_prefill(policy_dir: Path) -> None:
    """Same long request with and without chunking: with chunks of 512 the 4-token request finishes first and in
    a small fraction of the long one's time; the long request's sampled ids and logprobs are unchanged."""
    results = {}
    for chunk in (LONG + 1, 512):  # one whole-prompt prefill (what the engine did before), then chunks
        engine = Engine(policy_dir, device="cpu", prefill_chunk_tokens=chunk, prefix_cache_mb=0)
        try:
            results[chunk] = asyncio.run(_short_behind_long(engine, _long_prompt(engine)))
        finally:
            engine.close()
    whole, chunked = results[LONG + 1], results[512]
    print(
        f"short request waited {whole['short_wait_s']:.2f}s behind a {LONG}-token prefill unchunked, "
        f"{chunked['short_wait_s']:.2f}s chunked (long request {whole['long_s']:.2f}s / {chunked['long_s']:.2f}s)"
    )
    assert whole["short_wait_s"] > whole["long_s"] / 2  # the old behaviour: it waited for the whole prefill
    assert chunked["short_first"]
    assert chunked["short_wait_s"] < chunked["long_s"] / 4
    assert chunked["short_wait_s"] < whole["short_wait_s"] / 2
    assert chunked["long"]["token_ids"] == whole["long"]["token_ids"]
    worst = max(abs(a - b) for a, b in zip(chunked["long"]["logprobs"], whole["long"]["logprobs"], strict=True))
    assert worst < 1e-4


def test_a_prompt_past_the_limit_gets_a_400_naming_the_limit_and_its_length(policy_dir: Path) -> None:
    from clawpipe.serving.server import start_server

    handle = start_server(policy_dir, device="cpu", admin_token="a", max_model_len=4096, max_prompt_tokens=100)
    try:
        ok = httpx.post(f"{handle.url}/v1/completions", json={"prompt": list(range(5, 105)), "max_tokens": 2})
        over = httpx.post(f"{handle.url}/v1/completions", json={"prompt": list(range(5, 106)), "max_tokens": 2})
        messages = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "word " * 200}]}
        anthropic = httpx.post(f"{handle.url}/v1/messages", json=messages)
    finally:
        handle.stop()
    assert ok.status_code == 200
    assert over.status_code == 400
    message = over.json()["error"]["message"]
    assert "101 tokens" in message and "limit of 100 prompt tokens" in message
    assert anthropic.status_code == 400 and anthropic.json()["type"] == "error"
    assert "limit of 100 prompt tokens" in anthropic.json()["error"]["message"]
