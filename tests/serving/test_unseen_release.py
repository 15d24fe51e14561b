"""Ids handed out with their text (Detokenizer.release): for any ids and any stop string taken from their
text, what is released adds up to whole ids that decode to exactly the released text, which ends before the
stop string."""

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


def released(tok: Any, ids: list[int], stop: list[str]) -> tuple[list[int], str, Detokenizer]:
    d = Detokenizer(tok, stop, set())
    n, text = 0, ""
    for i, t in enumerate(ids):
        d.add(t)
        last = i == len(ids) - 1 or d.stopped_on is not None
        d.take(final=last)
        k, piece = d.release()
        assert k or not piece  # text never goes out without its ids
        n, text = n + k, text + piece
        if d.stopped_on is not None:
            break
    return ids[:n], text, d


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_released_ids_decode_to_the_released_text(tok: Any, data: st.DataObject) -> None:
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), min_size=1, max_size=60))
    full = tok.decode(ids, skip_special_tokens=False)
    out, text, _ = released(tok, ids, [])
    assert out == ids and text == full
    if len(full) > 4:
        a = data.draw(st.integers(0, len(full) - 2))
        stop = full[a : a + data.draw(st.integers(1, 3))]
        out, text, d = released(tok, ids, [stop])
        assert d.stopped_on == stop
        assert tok.decode(out, skip_special_tokens=False) == text
        assert full[: full.index(stop)].startswith(text) and stop not in text
