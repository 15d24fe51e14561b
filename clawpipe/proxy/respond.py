"""Writing a call's answer to its client once the call's record is durable (or failed to be)."""

from __future__ import annotations

from clawpipe.proxy import wire
from clawpipe.proxy.call import Call
from clawpipe.proxy.conn import ClientConn

NOT_RECORDED = 507  # Insufficient Storage: the proxy could not store the call's record


def after_call(
    conn: ClientConn,
    call: Call,
    failure: str | None,
    keep: bool,
    status: int,
    response: bytes,
    *,
    anthropic: bool,
) -> None:
    """Answer a forwarded call: its held stream end, or its whole response (the upstream's, or the error
    body the proxy recorded in its place), then go on with the connection's next request or close it.

    ``failure`` says why the call's record could not be written (None: it is on disk): then no answer is
    released as if captured: a 507 naming the cause, or a stream left unterminated."""
    if call.outcome == "cancelled" or conn.closed:
        conn.finish(False)
        return
    if call.streaming:
        if failure is None and call.outcome == "end":
            conn.write(b"".join(call.held) + (b"0\r\n\r\n" if call.chunked else b""))
            conn.finish(keep and call.chunked)
        else:
            conn.finish(False)  # an unterminated stream tells the client it is incomplete
        return
    if failure is not None:
        not_recorded(conn, failure, keep, anthropic=anthropic)
        return
    if call.outcome == "end":
        headers = call.resp_headers
        if not keep:
            headers = [*headers, (b"connection", b"close")]
        conn.write(wire.response_head(call.status, headers, length=len(response)) + response)
        conn.finish(keep)
        return
    send_json(conn, status, response, keep)


def send_json(conn: ClientConn, status: int, body: bytes, keep: bool, *, allow: str | None = None) -> None:
    """Answer with a JSON body the proxy made (an error in the API's shape); ``allow``: a 405's Allow header."""
    headers = [(b"content-type", b"application/json")]
    if status == 415:  # the proxy's only 415 refuses a coded body: say which coding it takes (RFC 9110 12.5.3)
        headers.append((b"accept-encoding", b"identity"))
    if allow is not None:  # the methods the path is served with (RFC 9110 15.5.6)
        headers.append((b"allow", allow.encode()))
    if not keep:
        headers.append((b"connection", b"close"))
    conn.write(wire.response_head(status, headers, length=len(body)) + body)
    conn.finish(keep)


def not_recorded(conn: ClientConn, failure: str, keep: bool, *, anthropic: bool) -> None:
    """A 507 for a call whose record could not be written: the call was not captured, so it must not be
    answered as if it were; the message names the cause (a full disk, no descriptor left)."""
    msg = f"the proxy could not record this call, so it was not captured ({failure}); retry once capture works"
    send_json(conn, NOT_RECORDED, wire.error_body(NOT_RECORDED, msg, anthropic=anthropic), keep)
