"""Which paths the proxy serves, and how it asks the upstream for token ids (docs/ARCHITECTURE.md, contract A).

The harness's body is forwarded with ``return_token_ids`` (and ``logprobs`` for chat/completions) added;
the capture keeps the original body and records the change in the header's ``request_changes``.
"""

from __future__ import annotations

import json
import re
from typing import Any

ROUTES = {
    ("POST", "/v1/chat/completions"): "chat",
    ("POST", "/v1/completions"): "completions",
    ("POST", "/v1/responses"): "responses",
    ("POST", "/v1/messages"): "messages",
    ("POST", "/v1/messages/count_tokens"): "count_tokens",
    ("GET", "/v1/models"): "models",
}
# Paths with an id in them: a model (names may hold "/"), a stored response read back or deleted
ID_ROUTES = (
    ("GET", re.compile(r"/v1/models/.+"), "models"),
    ("GET", re.compile(r"/v1/responses/[^/]+(/input_items)?"), "responses_read"),
    ("DELETE", re.compile(r"/v1/responses/[^/]+"), "responses_delete"),
)
# Sent without a body (GET, DELETE): forwarded as they are
BODYLESS_APIS = frozenset(("models", "responses_read", "responses_delete"))
METHODS = sorted({m for m, _ in ROUTES} | {m for m, _, _ in ID_ROUTES})
# every route as an error names it (an id route with its id as a placeholder)
ROUTE_NAMES = sorted(
    [f"{m} {p}" for m, p in ROUTES]
    + ["GET /v1/models/{model}", "GET /v1/responses/{id}", "GET /v1/responses/{id}/input_items"]
    + ["DELETE /v1/responses/{id}"]
)


def _route(method: str, path: str) -> str | None:
    api = ROUTES.get((method, path))
    if api is None:
        api = next((a for m, pattern, a in ID_ROUTES if m == method and pattern.fullmatch(path)), None)
    return api


def served_path(method: str, path: str) -> tuple[str, str | None]:
    """(the path as served, its API or None) for a request's path: as it is, with empty segments dropped (a
    base URL ending in "/" joined by concatenation: "/v1//chat/..."), or with "/v1" put in front (a base URL
    given without it)."""
    api = _route(method, path)
    if api is None and "//" in path:
        tidy = "/" + "/".join(p for p in path.split("/") if p)
        if _route(method, tidy) or _route(method, "/v1" + tidy):
            path, api = tidy, _route(method, tidy)
    if api is None and not path.startswith("/v1/"):
        api = _route(method, "/v1" + path)
        if api is not None:
            path = "/v1" + path
    return path, api


def allowed_methods(path: str) -> list[str]:
    """The methods some route serves ``path`` with (read as :func:`served_path` reads it): what a 405 allows."""
    return [m for m in METHODS if served_path(m, path)[1] is not None]


# The model calls: forwarded with token ids asked for (below). The others (models, count_tokens, stored
# responses read back) are forwarded as they are and captured with token_source "none", so training never
# sees them.
TOKEN_APIS = frozenset(("chat", "completions", "responses", "messages"))
# Fields added to the forwarded body per API (docs/ARCHITECTURE.md, contract A); logprobs only when absent or falsy.
WANTED_FIELDS: dict[str, dict[str, Any]] = {
    "chat": {"return_token_ids": True, "logprobs": True},
    "completions": {"return_token_ids": True, "logprobs": 1},
    "responses": {"return_token_ids": True},
    "messages": {"return_token_ids": True},
}


def prepare_body(api: str, body: bytes, obj: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """Ask the upstream for ids/logprobs; returns (forwarded body, request_changes).

    When every field is simply missing, the fields are spliced in after the opening brace (no re-encoding
    of a possibly large body); otherwise the object is re-serialized.
    """
    added: dict[str, Any] = {}
    changed: dict[str, Any] = {}
    for k, v in WANTED_FIELDS[api].items():
        if k not in obj:
            added[k] = v
        elif (k == "return_token_ids" and obj[k] is not True) or (k == "logprobs" and not obj[k]):
            changed[k] = [obj[k], v]
    if not added and not changed:
        return body, {}
    changes: dict[str, Any] = {}
    if added:
        changes["added"] = added
    if changed:
        changes["changed"] = changed
    if changed or not obj:
        new = dict(obj)
        new.update(added)
        new.update({k: v[1] for k, v in changed.items()})
        return json.dumps(new).encode(), changes
    i = body.find(b"{")
    ins = json.dumps(added, separators=(",", ":")).encode()[1:-1]
    return b"".join((body[: i + 1], ins, b",", body[i + 1 :])), changes
