"""A light client for a running policy server (httpx only, no torch): health and weight reload, for the local
engine (`POST /admin/reload`) and for vLLM (install weights in the served dir + `reload_weights`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from clawpipe.errors import ServingError


def server_health(url: str, timeout_s: float = 5) -> dict[str, Any]:
    """GET /health of the local engine: {"status", "policy_version", "model", "waiting", "running", ...}."""
    r = httpx.get(f"{url.rstrip('/').removesuffix('/v1')}/health", timeout=timeout_s)
    r.raise_for_status()
    return dict(r.json())


def request_reload(
    url: str, path: str | Path, policy_version: int, admin_token: str, timeout_s: float = 600
) -> dict[str, Any]:
    """Ask the local engine to load `path` as `policy_version`; returns when in-flight requests have finished
    and the new weights serve (the engine's answer: {"status": "ok", "policy_version": N, "path": ...})."""
    r = httpx.post(
        f"{url.rstrip('/').removesuffix('/v1')}/admin/reload",
        json={"path": str(path), "policy_version": policy_version},
        headers={"Authorization": f"Bearer {admin_token}"},
        timeout=timeout_s,
    )
    if r.status_code != 200:
        raise ServingError(f"reload of {path} refused ({r.status_code}): {r.text[:300]}")
    return dict(r.json())
