"""Incremental detokenization: what streams out equals decoding all ids at once, stop strings cut it exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clawpipe.serving.policy import load_tokenizer
from clawpipe.serving.text import Detokenizer


@pytest.fixture(scope="module")
def tok(policy_dir: Path) -> Any:
    return load_tokenizer(policy_dir)


def _stream(tok: Any, ids: list[int], stop: list[str]) -> tuple[str, Detokenizer]:
    d = Detokenizer(tok, stop, set())
    out = ""
    for i, t in enumerate(ids):
        d.add(t)
        last = i == len(ids) - 1 or d.stopped_on is not None
        out += d.take(final=last)
        if d.stopped_on is not None:
            break
    return out, d


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_streamed_text_equals_the_full_decode(tok: Any, data: st.DataObject) -> None:
    # any ids, so byte-level tokens that split multi-byte UTF-8 characters come up often
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), min_size=1, max_size=60))
    full = tok.decode(ids, skip_special_tokens=False)
    streamed, _ = _stream(tok, ids, [])
    assert streamed == full
    if len(full) > 4:
        a = data.draw(st.integers(0, len(full) - 2))
        stop = full[a : a + data.draw(st.integers(1, 3))]
        cut, d = _stream(tok, ids, [stop])
        assert d.stopped_on == stop and cut == full[: full.index(stop)]


def test_long_generations_decode_a_window_per_token(tok: Any) -> None:
    """Work per token stays bounded: the ids decoded per step do not grow with the length of the text."""
    seen: list[int] = []

    class Counting:
        def decode(self, ids: list[int], **kw: Any) -> str:
            seen.append(len(ids))
            return str(tok.decode(ids, **kw))

    ids = tok.encode("the quick brown fox jumps over the lazy dog " * 40, add_special_tokens=False)
    d = Detokenizer(Counting(), ["@@@"], set())
    for t in ids:
        d.add(t)
        d.take(final=False)
    d.take(final=True)
    assert d.text == tok.decode(ids) and len(ids) > 200 and max(seen) <= 4
