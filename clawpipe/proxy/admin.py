"""Admin endpoints of the proxy (``/admin/...``), all behind ``Authorization: Bearer <admin token>``.

``GET /admin/health``, ``GET /admin/ready``, ``GET /admin/stats``, ``POST /admin/pause`` (``{"wait_s": s}``:
new calls wait, returns once in-flight calls drained), ``POST /admin/resume`` (``{"policy_version": n}`` optional),
``GET|POST /admin/policy_version`` (``{"policy_version": n}``). ``policy_version`` is an integer in
[0, 2**31 - 1], ``wait_s`` a number of seconds in [0, 3600]; anything else is a 400 that changes nothing.

``/admin/health`` answers 200 while the proxy runs (liveness: its body says ``capture_failing``);
``/admin/ready`` is the readiness probe a load balancer in front of several proxies polls: 503 while calls
cannot be captured or no upstream is up (such a proxy would answer every call with a 507 or a 502), 200
otherwise, with the reasons in the body either way.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from clawpipe.proxy import wire
from clawpipe.proxy.config import ProxyConfig
from clawpipe.proxy.conn import ClientConn
from clawpipe.proxy.limits import MAX_POLICY_VERSION, valid_policy_version


class AdminTarget(Protocol):
    """What the admin endpoints read and change on the proxy (the server implements it)."""

    config: ProxyConfig
    policy_version: int
    stats: dict[str, int]

    def is_admin(self, authorization: bytes) -> bool: ...

    def health(self) -> dict[str, Any]: ...

    def readiness(self) -> tuple[bool, dict[str, Any]]: ...

    def snapshot_stats(self) -> dict[str, Any]: ...

    async def pause_calls(self, wait_s: float) -> dict[str, Any]: ...

    def resume_calls(self, policy_version: int | None = None) -> dict[str, Any]: ...


MAX_WAIT_S = 3600.0
_VERSION_HELP = f'send {{"policy_version": <integer in [0, {MAX_POLICY_VERSION}]>}}'


async def handle_admin(proxy: AdminTarget, conn: ClientConn, req: wire.Request) -> None:
    keep = req.keep_alive
    token = req.headers.get(b"authorization", b"")
    if not proxy.is_admin(token):
        proxy.stats["unauthorized"] += 1
        conn.write(
            wire.error_response(401, "admin endpoints need Authorization: Bearer <admin token>", anthropic=False)
        )
        conn.finish(keep)
        return
    try:
        args = json.loads(req.body) if req.body.strip() else {}
        if not isinstance(args, dict):
            raise ValueError("body must be a JSON object")
    except (ValueError, RecursionError) as exc:
        conn.write(wire.error_response(400, f"admin body is not a JSON object: {exc}", anthropic=False))
        conn.finish(keep)
        return
    path, method = req.path, req.method
    status, out = 200, None
    if path == "/admin/health" and method == "GET":
        out = proxy.health()
    elif path == "/admin/ready" and method == "GET":
        ready, out = proxy.readiness()
        status = 200 if ready else 503
    elif path == "/admin/stats" and method == "GET":
        out = proxy.snapshot_stats()
    elif path == "/admin/pause" and method == "POST":
        wait_s = args.get("wait_s", min(proxy.config.drain_timeout_s, MAX_WAIT_S))
        if not _number(wait_s) or not 0 <= wait_s <= MAX_WAIT_S:
            msg = f'send {{"wait_s": <seconds in [0, {MAX_WAIT_S:g}]>}} (or no body)'
            status, out = 400, {"error": {"message": msg}}
        else:
            out = await proxy.pause_calls(float(wait_s))
    elif path == "/admin/resume" and method == "POST":
        version = args.get("policy_version")
        if version is not None and not valid_policy_version(version):
            status, out = 400, {"error": {"message": _VERSION_HELP + " (or no policy_version)"}}
        else:
            out = proxy.resume_calls(version)
    elif path == "/admin/policy_version" and method in ("GET", "POST", "PUT"):
        if method != "GET":
            if not valid_policy_version(args.get("policy_version")):
                status, out = 400, {"error": {"message": _VERSION_HELP}}
            else:
                proxy.policy_version = args["policy_version"]
        if out is None:
            out = {"policy_version": proxy.policy_version}
    else:
        status, out = 404, {"error": {"message": f"unknown admin endpoint {method} {path}"}}
    conn.write(wire.json_response(status, out, keep_alive=keep))
    conn.finish(keep)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value  # not NaN
