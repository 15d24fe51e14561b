"""Content codings of upstream answers: the proxy asks for ``identity``, and decodes what comes coded anyway.

The proxy sends ``Accept-Encoding: identity`` upstream (a request without the field would allow any coding,
RFC 9110), so a compliant upstream answers uncoded. An upstream that codes its answer all the same gets it
decoded here, so the harness reads it whatever it asked for and the capture holds the JSON or SSE that the
lake parses. Only zlib's codings are decoded (gzip, deflate); decoding stops at the response size limit, so
a small coded answer cannot grow into a large one (a compression bomb).
"""

from __future__ import annotations

import zlib

_GZIP = 16 + zlib.MAX_WBITS  # a gzip header and trailer around the deflate data
_ZLIB = zlib.MAX_WBITS  # a zlib header and checksum around it (what "deflate" means, RFC 9110 8.4.1.2)
_RAW = -zlib.MAX_WBITS  # bare deflate data, which some servers send as "deflate"


def codings(value: bytes | None) -> list[str]:
    """The codings a Content-Encoding value names, in the order they were applied (``identity`` left out)."""
    if not value:
        return []
    named = (c.strip(b" \t").lower().decode("latin-1") for c in value.split(b","))
    return [c for c in named if c and c != "identity"]


def decode(names: list[str], data: bytes, limit: int) -> bytes:
    """``data`` with the codings ``names`` undone (last applied, first undone); raises ValueError saying why
    it cannot be: a coding the proxy does not decode, data that is not in the coding, or over ``limit`` bytes."""
    for name in reversed(names):
        if name in ("gzip", "x-gzip"):
            data = _inflate(name, data, _GZIP, limit)
        elif name == "deflate":
            try:
                data = _inflate(name, data, _ZLIB, limit)
            except zlib.error:
                data = _inflate(name, data, _RAW, limit)
        else:
            raise ValueError(
                f"upstream answered in Content-Encoding {name!r}, which the proxy does not decode (it asks for "
                "identity; gzip and deflate are decoded): configure the upstream not to compress its answers"
            )
    return data


def _inflate(name: str, data: bytes, wbits: int, limit: int) -> bytes:
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error:
        if wbits == _ZLIB:
            raise  # deflate: tried again as bare deflate data
        raise ValueError(f"upstream answer in Content-Encoding {name!r} could not be decoded") from None
    if len(out) > limit:
        raise ValueError(f"decoded upstream response larger than the proxy's limit of {limit} bytes")
    if not d.eof:
        raise ValueError(f"upstream answer in Content-Encoding {name!r} could not be decoded: it is cut short")
    return out
