"""The pure outcome-to-status rule of the proxy: every way a forwarded call can end, one captured status."""

from __future__ import annotations

import json

import pytest

from clawpipe.proxy.outcome import Outcome, judge

UP = "http://up"


@pytest.mark.parametrize(
    ("outcome", "status", "streaming", "want"),
    [
        ("end", 200, False, ("ok", 200, None)),
        ("end", 200, True, ("ok", 200, None)),
        ("end", 429, False, ("http_error", 429, None)),
        ("cancelled", 0, False, ("cancelled", 499, None)),
        ("cancelled", 200, True, ("cancelled", 200, None)),
        ("shutdown", 0, False, ("cancelled", 503, 5)),
        ("shutdown", 200, True, ("cancelled", 200, None)),
        ("fail", 0, False, ("upstream_error", 502, 5)),
        ("timeout", 0, False, ("upstream_error", 504, 5)),
        ("too_large", 200, False, ("upstream_error", 502, 5)),
        ("too_large", 200, True, ("upstream_error", 200, None)),
    ],
)
def test_each_end_of_a_call_has_one_captured_status(outcome, status, streaming, want):
    v = judge(Outcome(outcome, status, streaming, "what happened", UP, 5), b"12345", anthropic=False)
    assert (v.status, v.http_status, v.partial) == want
    if want[2] is not None:  # the recorded body is the error the client gets, in the API's shape
        assert "what happened" in json.loads(v.response)["error"]["message"]
    else:
        assert v.response == b"12345"
    anthropic = judge(Outcome(outcome, status, False, "x", UP, 5), b"12345", anthropic=True)
    if anthropic.partial is not None:
        assert json.loads(anthropic.response)["type"] == "error"
