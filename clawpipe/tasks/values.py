"""Plain JSON values from untrusted bytes, and comparison by value.

A verifier decides a reward from data it parses itself: :func:`parse_plain_json` turns bytes written by a
harness or a sandboxed check into dicts, lists, strings, numbers, booleans and None, within limits on size,
nesting depth and element count, rejecting NaN/Infinity (also as overflowing literals like ``1e999``) and
duplicate keys. :func:`same_value` compares such values by JSON value, with no method of the untrusted side
involved: ``True`` is not ``1``, a string is not a number, lists compare element by element.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 32
MAX_ITEMS = 200_000


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a plain JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} does not fit a finite number")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key[:60]!r}")
        out[key] = value
    return out


def _check_shape(value: Any, max_depth: int, max_items: int) -> None:
    """Walk ``value`` without recursion; ValueError past ``max_depth`` levels or ``max_items`` elements."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    items = 0
    while stack:
        node, depth = stack.pop()
        items += 1
        if items > max_items:
            raise ValueError(f"more than {max_items} elements")
        if isinstance(node, (dict, list)):
            if depth > max_depth:
                raise ValueError(f"nested deeper than {max_depth} levels")
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)


def parse_plain_json(
    data: bytes,
    *,
    max_bytes: int,
    max_depth: int = MAX_DEPTH,
    max_items: int = MAX_ITEMS,
    errors: str = "strict",
) -> Any:
    """One JSON document of plain values from ``data``; ValueError saying what is wrong.

    ``errors`` is how undecodable UTF-8 is handled ("strict" rejects it, "replace" keeps the rest).
    """
    if len(data) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    try:
        text = data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8: {exc.reason} at byte {exc.start}") from exc
    try:
        value = json.loads(
            text, parse_constant=_reject_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys
        )
    except RecursionError as exc:
        raise ValueError(f"nested deeper than {max_depth} levels") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})") from exc
    except ValueError as exc:  # from the hooks above, or an integer with more digits than Python converts
        raise ValueError(str(exc)[:200]) from exc
    _check_shape(value, max_depth, max_items)
    return value


def same_value(got: Any, expected: Any) -> bool:
    """Whether two plain JSON values are equal as JSON values (bool, number, string, null, list, object).

    Only the built-in types are accepted (``type(x) is ...``), so an object whose ``__eq__`` always says
    yes never matches. Integers and floats compare numerically (3 matches 3.0); booleans only match booleans.
    """
    stack = [(got, expected)]
    while stack:
        a, b = stack.pop()
        ta, tb = type(a), type(b)
        if tb is bool or ta is bool:
            if not (ta is bool and tb is bool and a is b):
                return False
        elif tb in (int, float):
            if ta not in (int, float) or a != b:
                return False
        elif tb is str or tb is type(None):
            if ta is not tb or a != b:
                return False
        elif tb is list:
            if ta is not list or len(a) != len(b):
                return False
            stack.extend(zip(a, b, strict=True))
        elif tb is dict:
            if ta is not dict or a.keys() != b.keys():
                return False
            stack.extend((a[k], b[k]) for k in b)
        else:
            return False
    return True
