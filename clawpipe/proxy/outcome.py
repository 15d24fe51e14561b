"""How a forwarded call's outcome becomes its captured status and what its client is told.

A pure function of the call's end (:class:`Outcome`): no I/O, so every case is testable on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from clawpipe.capture import CallStatusName
from clawpipe.proxy import wire


@dataclass(slots=True)
class Outcome:
    """How a forwarded call ended, as the upstream connection and the proxy saw it."""

    outcome: str  # end | fail | timeout | cancelled | shutdown | too_large
    status: int  # the upstream's HTTP status (0: no head received)
    streaming: bool  # the stream's head (and maybe some events) already went to the client
    error: str | None
    upstream: str | None
    received: int  # response body bytes the upstream sent


@dataclass(slots=True)
class Verdict:
    """The capture header's fields and the response body to record (and send, when not streaming)."""

    status: CallStatusName
    http_status: int
    error: str | None
    response: bytes
    partial: int | None = None  # bytes the upstream had sent, when the recorded body replaces them


def judge(o: Outcome, response: bytes, *, anthropic: bool) -> Verdict:
    """The captured status and recorded body of a forwarded call (``response``: the body bytes kept)."""
    if o.outcome == "end":
        if o.status >= 400:
            return Verdict("http_error", o.status, response[:500].decode("utf-8", "replace"), response)
        return Verdict("ok", o.status, None, response)
    if o.outcome == "cancelled":  # the client went away: it got the upstream's status only with a stream's head
        return Verdict("cancelled", o.status if o.streaming else 499, o.error, response)
    if o.outcome == "shutdown":
        if o.streaming:
            return Verdict("cancelled", o.status, o.error, response)
        body = wire.error_body(503, f"{o.error}; retry the call", anthropic=anthropic)
        return Verdict("cancelled", 503, o.error, body, o.received)
    # fail | timeout | too_large: the upstream's fault
    code = 504 if o.outcome == "timeout" else 502
    if o.streaming:  # the client already has a 200 head: it gets an unterminated stream
        return Verdict("upstream_error", o.status, o.error, response)
    body = wire.error_body(code, f"upstream {o.upstream}: {o.error}", anthropic=anthropic)
    return Verdict("upstream_error", code, o.error, body, o.received)
