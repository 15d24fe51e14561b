"""The SSE reader: events split across chunks anywhere read the same as in one piece; the standard's
grammar (multi-line data, comments, event names, CRLF and CR line ends) and the writer's framing round-trip."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from clawpipe.apis import SSEEvent, SSEReader, read_events, sse_frame

_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=30)


@st.composite
def _streams(draw: st.DrawFn) -> tuple[bytes, list[SSEEvent]]:
    """A wire stream of events (random line ends, comments, names, multi-line data) and the events it holds."""
    newline = draw(st.sampled_from(["\n", "\r\n", "\r"]))
    wire, want = [], []
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.booleans()):
            wire.append(":" + draw(_TEXT) + newline)  # comment, e.g. a keep-alive
        event = draw(st.none() | st.from_regex(r"[a-z_.]{1,12}", fullmatch=True))
        lines = draw(st.lists(_TEXT, min_size=1, max_size=3))
        if event is not None:
            wire.append(f"event: {event}{newline}")
        wire += [f"data: {line}{newline}" for line in lines]
        wire.append(newline)
        want.append(SSEEvent("\n".join(lines).encode(), event))
    return "".join(wire).encode(), want


@settings(max_examples=300, deadline=None)
@given(case=_streams(), data=st.data())
def test_random_chunking_gives_the_same_events(case: tuple[bytes, list[SSEEvent]], data: st.DataObject) -> None:
    wire, want = case
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=12)))
    reader, got = SSEReader(), []
    for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True):
        got += reader.feed(wire[a:b])
    got += reader.close()
    assert got == want
    assert read_events(wire) == want


def test_multi_line_data_is_joined_with_newlines_and_one_leading_space_dropped() -> None:
    wire = b'event: x\r\ndata: {"a":\r\ndata:  1}\r\n\r\n: ping\r\ndata:[DONE]\r\n\r\n'
    assert read_events(wire) == [SSEEvent(b'{"a":\n 1}', "x"), SSEEvent(b"[DONE]")]


def test_crlf_split_between_feeds_is_one_line_end() -> None:
    reader = SSEReader()
    assert reader.feed(b"data: a\r") == []
    assert reader.feed(b"\n") == []
    assert reader.feed(b"\r\n") == [SSEEvent(b"a")]


def test_unterminated_last_event_is_kept_at_close() -> None:
    reader = SSEReader()
    assert reader.feed(b'data: {"a": 1}\n\ndata: {"b"') == [SSEEvent(b'{"a": 1}')]
    assert reader.close() == [SSEEvent(b'{"b"')]


def test_frame_reads_back_as_its_event_and_json() -> None:
    payload = {"type": "content_block_delta", "delta": {"text": "é\nnew line"}}
    (ev,) = read_events(sse_frame(payload, "content_block_delta"))
    assert ev.event == "content_block_delta" and json.loads(ev.data) == payload
