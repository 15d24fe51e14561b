"""The checks a model call's JSON body passes before it is forwarded (RFC 8259 JSON, one object, sent
without a content coding: the proxy forwards no Content-Encoding and reads the body itself).

The proxy reads the body to add the token-id fields (:mod:`~clawpipe.proxy.routes`) and to know whether the
answer streams, so it must read it exactly as the upstream and the lake will: UTF-8 without a byte order
mark (``json.loads`` on bytes would also take UTF-16/32, which the field splice would corrupt, and encoded
surrogates), no ``NaN``/``Infinity`` and no number too large for a double (not JSON, or read as infinity,
which the field splice would write back as ``Infinity``; the lake's parser refuses both), and a ``stream`` that
is a boolean (an upstream that coerces ``1`` or ``"true"`` would stream an answer the proxy takes for a whole one).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import msgspec

from clawpipe.proxy.routes import TOKEN_APIS, prepare_body
from clawpipe.proxy.wire import BadRequest

_BOM = b"\xef\xbb\xbf"


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value: send a number or null")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:40]} is out of range for a double")
    return value


def parse_body(body: bytes, content_encoding: bytes | None = None) -> dict[str, Any]:
    """The body's JSON object; raises :class:`BadRequest` (400, 415) saying what is wrong and what to send."""
    coding = (content_encoding or b"").strip(b" \t").lower()
    if coding not in (b"", b"identity"):
        raise BadRequest(
            415, f"Content-Encoding {coding[:40].decode('latin-1')!r} is not supported: send the body uncompressed"
        )
    if body.startswith(_BOM):
        raise BadRequest(400, "request body starts with a byte order mark: send UTF-8 JSON without one")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(400, f"request body is not UTF-8 (byte {exc.start}): send the JSON encoded as UTF-8") from exc
    try:
        obj = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise BadRequest(400, "request body must be a JSON object")
    stream = obj.get("stream")
    if stream is not None and not isinstance(stream, bool):
        # a scalar is shown; an array or object may nest too deep to encode again
        shown = json.dumps(stream)[:40] if isinstance(stream, str | int | float) else f"a {type(stream).__name__}"
        raise BadRequest(400, f"stream must be true or false, not {shown}")
    return obj


@dataclass(slots=True)
class CallBody:
    """What a call keeps of its body once it is checked: the bytes to forward and the fields it records."""

    forwarded: bytes
    stream: bool
    model: str | None
    request_changes: msgspec.Raw | None  # the fields added or changed (routes.prepare_body), encoded


def read_call_body(api: str, body: bytes, content_encoding: bytes | None) -> CallBody:
    """Check a model call's body and ask for its token ids. The parsed object is dropped on return: it can
    take many times the body's memory, and the call may wait minutes for its answer."""
    obj = parse_body(body, content_encoding)
    model = obj.get("model")
    forwarded, changes = prepare_body(api, body, obj) if api in TOKEN_APIS else (body, {})
    return CallBody(
        forwarded,
        obj.get("stream") is True,
        model if isinstance(model, str) else None,
        msgspec.Raw(msgspec.json.encode(changes)) if changes else None,
    )
