"""HTTP/1.1 wire helpers of the proxy: chunk sizes, response heads, OpenAI/Anthropic error bodies.

Kept deliberately small and allocation-light: the proxy's hot path runs through here once per call.
"""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass, field

REASONS = {
    100: "Continue",
    200: "OK",
    204: "No Content",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    411: "Length Required",
    413: "Payload Too Large",
    415: "Unsupported Media Type",
    431: "Request Header Fields Too Large",
    499: "Client Closed Request",
    500: "Internal Server Error",
    501: "Not Implemented",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    507: "Insufficient Storage",
}

# Response headers from the upstream that the proxy sets itself or that are hop-by-hop.
HOP_BY_HOP = frozenset(
    (b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"te", b"trailer", b"upgrade")
)
# Request headers forwarded to the upstream (everything else, auth included, stays at the proxy).
FORWARDED_REQUEST_HEADERS = frozenset(
    (b"content-type", b"accept", b"anthropic-version", b"anthropic-beta", b"openai-beta", b"x-request-id")
)

ROLLOUT_HEADER = b"x-clawpipe-rollout"

# The request line of the connection preface of an HTTP/2 client that assumes the server speaks HTTP/2
# (prior knowledge, RFC 9113 3.3): such a client reads only HTTP/2 frames, never an HTTP/1.1 answer.
H2_PREFACE_LINE = b"PRI * HTTP/2.0"
_H2_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty SETTINGS frame: the server's preface
_H2_GOAWAY = 0x7
_H2_HTTP_1_1_REQUIRED = 0xD


def rollout_header(run_id: str, iteration: int, rollout_id: str) -> bytes:
    """The header line naming a call's rollout to the engine: ``run/iteration/rollout``, percent-encoded so no
    id can break the header (the names never hold '/': clawpipe.keys refuses them)."""
    value = urllib.parse.quote(f"{run_id}/{iteration}/{rollout_id}", safe="/")
    return ROLLOUT_HEADER + b": " + value.encode("ascii") + b"\r\n"


OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout",
    413: "invalid_request_error",
    415: "invalid_request_error",
    431: "invalid_request_error",
    500: "server_error",
    501: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout",
}
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    431: "invalid_request_error",
    500: "api_error",
    501: "invalid_request_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


class BadRequest(Exception):
    """A request the proxy cannot parse; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class Request:
    method: str
    target: str  # path + query as sent (an absolute-form target: its path + query)
    path: str
    query: str
    version: bytes
    headers: dict[bytes, bytes]
    body: bytes = b""
    keep_alive: bool = True
    extra: dict[str, object] = field(default_factory=dict)


_HEX = frozenset(b"0123456789abcdefABCDEF")
_CONTROL = bytes([*range(9), *range(10, 32), 127])  # control characters but HTAB


def chunk_size(line: bytes) -> int:
    """The size on a chunk-size line (extensions after ';' ignored). Only hex digits count: int(x, 16) would
    also take '-6', '+6', '0x6' or '6_0', and a negative size walks a parser backwards forever. No control
    character either, extensions included: a bare LF there ends the line for parsers that split on LF."""
    if len(line.translate(None, _CONTROL)) != len(line):
        raise ValueError(f"control character in chunk-size line {bytes(line[:40])!r}")
    digits = line.split(b";", 1)[0].strip()
    if not digits or len(digits) > 16 or not _HEX.issuperset(digits):
        raise ValueError(f"malformed chunk size {bytes(line[:40])!r}")
    return int(digits, 16)


def response_head(status: int, headers: list[tuple[bytes, bytes]] | tuple[()] = (), *, length: int | None) -> bytes:
    """Build a response head; ``length=None`` means chunked transfer encoding, ``-1`` a body that ends when the
    connection closes (streams to HTTP/1.0 clients, which do not know chunked encoding)."""
    out = [b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status, "Status").encode())]
    for name, value in headers:
        out.append(name + b": " + value + b"\r\n")
    if length is None:
        out.append(b"transfer-encoding: chunked\r\n\r\n")
    elif length < 0:
        out.append(b"connection: close\r\n\r\n")
    else:
        out.append(b"content-length: %d\r\n\r\n" % length)
    return b"".join(out)


def h2_refusal(message: str) -> bytes:
    """The answer to an HTTP/2 prior-knowledge connection: the server preface (its SETTINGS frame, which the
    client waits for) and a GOAWAY with error HTTP_1_1_REQUIRED and ``message`` as its debug data, which
    HTTP/2 clients report; no stream is processed (last stream id 0)."""
    payload = (0).to_bytes(4, "big") + _H2_HTTP_1_1_REQUIRED.to_bytes(4, "big") + message.encode()[:16000]
    goaway = len(payload).to_bytes(3, "big") + bytes((_H2_GOAWAY, 0)) + (0).to_bytes(4, "big") + payload
    return _H2_SETTINGS + goaway


def error_body(status: int, message: str, *, anthropic: bool, code: str | None = None) -> bytes:
    """An error body in the shape the harness's SDK expects for its API."""
    if anthropic:
        obj: dict[str, object] = {
            "type": "error",
            "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message},
        }
    else:
        obj = {
            "error": {
                "message": message,
                "type": OPENAI_ERROR_TYPES.get(status, "server_error"),
                "param": None,
                "code": code or str(status),
            }
        }
    return json.dumps(obj).encode()


def error_body_any(status: int, message: str) -> bytes:
    """An error body both SDKs read, for answers sent before the request's API is known (framing errors,
    timeouts, the connection cap): Anthropic's shape with OpenAI's fields added to its ``error`` object."""
    obj = {
        "type": "error",
        "error": {
            "type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"),
            "message": message,
            "param": None,
            "code": str(status),
        },
    }
    return json.dumps(obj).encode()


def error_response(status: int, message: str, *, anthropic: bool | None, keep_alive: bool = True) -> bytes:
    """A complete error response; ``anthropic=None`` when the API is not known (:func:`error_body_any`)."""
    body = error_body_any(status, message) if anthropic is None else error_body(status, message, anthropic=anthropic)
    headers = [(b"content-type", b"application/json")]
    if not keep_alive:
        headers.append((b"connection", b"close"))
    return response_head(status, headers, length=len(body)) + body


def json_response(status: int, obj: object, *, keep_alive: bool = True) -> bytes:
    body = json.dumps(obj).encode()
    headers = [(b"content-type", b"application/json")]
    if not keep_alive:
        headers.append((b"connection", b"close"))
    return response_head(status, headers, length=len(body)) + body
