"""Calls the serving edge tests make against a live engine: one API's request, its error message (checked to be
in that API's own shape), and JSON read as strictly as a client's parser reads it."""

from __future__ import annotations

import json
from typing import Any

import httpx

MSGS = [{"role": "user", "content": "hi"}]
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


def strict(text: str) -> Any:
    """JSON as a strict parser reads it: NaN and Infinity are not JSON."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def stream_events(text: str) -> list[Any]:
    return [strict(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def post(server: Any, api: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{PATHS[api]}", json={"model": "tiny", **body}, timeout=60)


def error_message(api: str, r: httpx.Response) -> str:
    """The message of an error response, checking it has the API's own shape."""
    body = r.json()
    if api == "messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    else:
        assert body["error"]["type"] == "invalid_request_error", body
    return str(body["error"]["message"])
