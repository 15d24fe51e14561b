"""The Responses store's budget: what an entry counts against ``max_bytes``."""

from __future__ import annotations

from clawpipe.serving.response_store import ResponseStore


def _answer(rid: str, n: int) -> tuple[list[dict[str, object]], dict[str, object]]:
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": rid * n}]}]
    return output, {"id": rid, "object": "response", "output": output, "token_ids": list(range(n))}


def test_a_responses_output_counts_once_against_the_budget() -> None:
    # before: the output items were counted twice (as items and inside the response object), so two answers
    # of ~100 KB each did not fit a 250 KB store: the second pushed the first out
    store = ResponseStore(max_responses=10, max_bytes=250_000)
    for rid in ("resp_a", "resp_b"):
        output, response = _answer(rid, 16_000)  # ~96 KB of text each
        store.put(rid, [{"role": "user", "content": "hi"}], output, response)
    assert store.response("resp_a") is not None and store.response("resp_b") is not None
    assert "token_ids" not in (store.response("resp_b") or {})  # per-token fields are not kept or counted


def test_the_budget_still_evicts_the_oldest() -> None:
    store = ResponseStore(max_responses=10, max_bytes=250_000)
    for rid in ("resp_a", "resp_b", "resp_c"):
        output, response = _answer(rid, 16_000)
        store.put(rid, [{"role": "user", "content": "hi"}], output, response)
    assert store.response("resp_a") is None
    assert store.response("resp_b") is not None and store.response("resp_c") is not None
