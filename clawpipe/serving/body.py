"""A request's body: read up to a size limit, parsed as one JSON object, its nesting bounded, and checked
for the fields every API shares; each failure a RequestError saying what is wrong (413 for the size)."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request

from clawpipe.serving import convert
from clawpipe.serving.params import RequestError
from clawpipe.serving.text import nests_deeper

MAX_REQUEST_BYTES = 32 * 2**20  # Anthropic's own limit; tokenizing a body costs ~80x its size in memory
# JSON nesting a body may have: tool schemas nest ~20 deep, while Python's json (the chat template's tojson,
# the response encoder) gives up near 1000 levels less the stack it runs on
MAX_DEPTH = 100


async def json_body(request: Request, max_bytes: int = MAX_REQUEST_BYTES) -> dict[str, Any]:
    """The request's JSON object, or RequestError saying why not (orjson: strict UTF-8, no lone surrogates,
    nesting bounded); a body over max_bytes is refused (413) as soon as its length says so, unread."""
    try:
        body = orjson.loads(await _body(request, max_bytes) or b"{}")
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if nests_deeper(body, MAX_DEPTH):
        raise RequestError(f"the request body nests deeper than {MAX_DEPTH} levels of objects and lists; flatten it")
    convert.check_common(body)
    return body


async def _body(request: Request, max_bytes: int) -> bytes:
    """The body's bytes, read up to max_bytes: a declared or actual length past it raises a 413 RequestError."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():  # chunked bodies declare no length: count as they come
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(max_bytes: int) -> RequestError:
    return RequestError(
        f"the request body is over this server's limit of {max_bytes} bytes; send a shorter conversation "
        "(the operator sets the limit: max_request_mb, default 32)",
        status=413,
        code="request_too_large",
    )
