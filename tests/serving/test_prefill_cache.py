"""A prefilled request served twice through the prefix cache: the second reuses the first's KV and gives the
same ids and the same logprobs, which are the model's own for the open-turn prompt (computed directly)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from clawpipe.serving import policy
from tests.serving.calls import post

LONG_USER = [{"role": "user", "content": "Read the file and run the tests, then answer in JSON. " * 12}]
PREFILL = '{"answer": "<|im_end|>'


@pytest.fixture(scope="module")
def reference(scripted_dir: Path) -> Any:
    return policy.load_model(scripted_dir, "cpu")


def _body(api: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": 8,
        "temperature": 0.8,
        "seed": 7,
        "messages": [*LONG_USER, {"role": "assistant", "content": PREFILL}],
    }
    if api == "chat":
        body.update(continue_final_message=True, add_generation_prompt=False, logprobs=True)
    return body


def _ids_and_logprobs(api: str, got: dict[str, Any]) -> tuple[list[int], list[float]]:
    if api == "messages":
        return got["token_ids"], [e["logprob"] for e in got["logprobs"]["content"]]
    choice = got["choices"][0]
    return choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]


@pytest.mark.slow
@pytest.mark.parametrize("api", ["messages", "chat"])
def test_a_prefilled_request_served_twice_hits_the_prefix_cache_and_stays_exact(
    server: Any, reference: Any, api: str
) -> None:
    first = post(server, api, _body(api))
    assert first.status_code == 200, first.text
    hits = server.engine.stats["prefix_hit_tokens"]
    second = post(server, api, _body(api))
    assert second.status_code == 200, second.text
    prompt = first.json()["prompt_token_ids"]
    assert len(prompt) > 128  # long enough for the prefix cache
    assert second.json()["prompt_token_ids"] == prompt
    assert server.engine.stats["prefix_hit_tokens"] - hits >= len(prompt) - 1
    ids, logprobs = _ids_and_logprobs(api, first.json())
    again, again_lp = _ids_and_logprobs(api, second.json())
    assert again == ids and ids
    assert max(abs(a - b) for a, b in zip(again_lp, logprobs, strict=True)) < 1e-4
    want = policy.compute_logprobs(reference, prompt, ids, 0.8)
    assert max(abs(a - b) for a, b in zip(logprobs, want, strict=True)) < 1e-4
