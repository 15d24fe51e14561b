"""Which upstream replica takes a call: load balancing, per-rollout stickiness, draining and back-off.

A rollout's first call goes to the replica with the fewest calls in flight (ties broken by a hash of the
rollout id, so idle replicas still split rollouts evenly); its later calls stay on that replica while it is
in rotation, so the engine's prefix cache and per-rollout state stay useful. A replica leaves rotation when

- it is drained (``POST /admin/replicas/drain``, e.g. while its weights are republished): no new calls,
  in-flight ones finish; ``POST /admin/replicas/undrain`` brings it back;
- it fails (connection refused or broken, or a 502/503 answer): it is skipped for a back-off period that
  doubles with each consecutive failure (capped at 16 times the base) and ends at its next good answer.

A rollout whose replica left rotation moves to the least loaded one and stays there. When every replica
not drained is backing off, calls still go to the one whose back-off ends first (trying beats failing).

Admin endpoints (``Authorization: Bearer <admin token>``): ``GET /admin/replicas`` lists each replica's
state (up | draining | down), calls in flight, calls sent, errors and last error; ``POST
/admin/replicas/drain`` and ``/admin/replicas/undrain`` take ``{"upstream": "<one of the configured URLs>"}``.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, Protocol

from clawpipe.proxy import wire
from clawpipe.proxy.conn import ClientConn
from clawpipe.proxy.upstream import Replica

log = logging.getLogger(__name__)

RETRY_STATUSES = (502, 503)  # answers of a replica that did not serve the call: it is down or going down
MAX_BACKOFF_FACTOR = 16
_MAX_STICKY = 500_000


class ReplicaSet:
    """The replicas of one proxy and the rollout -> replica map (used on the proxy's event loop only)."""

    def __init__(self, replicas: Sequence[Replica], clock: Callable[[], float], backoff_s: float = 5.0) -> None:
        self.replicas = list(replicas)
        self._clock = clock
        self.backoff_s = backoff_s
        self._sticky: dict[str, Replica] = {}
        self._index = {r.url: r for r in self.replicas}

    def __iter__(self) -> Iterator[Replica]:
        return iter(self.replicas)

    def __len__(self) -> int:
        return len(self.replicas)

    def state(self, rep: Replica) -> str:
        if rep.draining:
            return "draining"
        return "down" if rep.down_until > self._clock() else "up"

    def pick(self, rollout_id: str, exclude: Collection[Replica] = ()) -> Replica | None:
        """The replica for this rollout's next call, ``None`` when every one is drained or excluded.

        Pure: the rollout is bound to the replica by :meth:`bind` once a call was sent there.
        """
        now = self._clock()
        open_ = [r for r in self.replicas if not r.draining and r not in exclude]
        if not open_:
            return None
        up = [r for r in open_ if r.down_until <= now]
        if not up:
            return min(open_, key=lambda r: r.down_until)
        sticky = self._sticky.get(rollout_id)
        if sticky is not None and sticky in up:
            return sticky
        n = len(self.replicas)
        start = zlib.crc32(rollout_id.encode()) % n
        order = {id(r): (i - start) % n for i, r in enumerate(self.replicas)}
        return min(up, key=lambda r: (r.in_flight, order[id(r)]))

    def bind(self, rollout_id: str, rep: Replica) -> None:
        """The rollout's later calls go to ``rep`` while it stays in rotation."""
        if self._sticky.get(rollout_id) is rep:
            return
        if len(self._sticky) >= _MAX_STICKY:  # bounded memory over a long run; rollouts re-pick by load
            self._sticky.clear()
        self._sticky[rollout_id] = rep

    def report(self, rep: Replica, sent: bool, outcome: str, status: int, error: str | None) -> None:
        """Mark the replica down or up from one exchange's end (timeouts and cancels say nothing)."""
        if not sent or outcome == "fail" or (outcome == "end" and status in RETRY_STATUSES):
            self._failed(rep, error or f"answered {status}")
        elif outcome == "end":
            rep.failures = 0
            rep.down_until = 0.0

    def _failed(self, rep: Replica, error: str) -> None:
        rep.errors += 1
        rep.failures += 1
        rep.last_error = error
        wait = self.backoff_s * min(2 ** (rep.failures - 1), MAX_BACKOFF_FACTOR)
        rep.down_until = self._clock() + wait
        log.warning("upstream replica down for %.1fs url=%s error=%s", wait, rep.url, error)

    def find(self, url: object) -> Replica | None:
        return self._index.get(url.rstrip("/")) if isinstance(url, str) else None

    def describe(self, rep: Replica) -> dict[str, Any]:
        return {
            "upstream": rep.url,
            "state": self.state(rep),
            "in_flight": rep.in_flight,
            "calls": rep.calls,
            "errors": rep.errors,
            "last_error": rep.last_error,
            "down_for_s": round(max(0.0, rep.down_until - self._clock()), 3),
        }

    def listing(self) -> dict[str, Any]:
        return {"replicas": [self.describe(r) for r in self.replicas]}


class ReplicaAdminTarget(Protocol):
    """What the replica admin endpoints need from the proxy."""

    replicas: ReplicaSet
    stats: dict[str, int]

    def is_admin(self, authorization: bytes) -> bool: ...


async def handle_replica_admin(proxy: ReplicaAdminTarget, conn: ClientConn, req: wire.Request) -> None:
    """``GET /admin/replicas``, ``POST /admin/replicas/drain`` and ``POST /admin/replicas/undrain``."""
    keep = req.keep_alive
    if not proxy.is_admin(req.headers.get(b"authorization", b"")):
        proxy.stats["unauthorized"] += 1
        msg = "admin endpoints need Authorization: Bearer <admin token>"
        conn.write(wire.error_response(401, msg, anthropic=False, keep_alive=keep))
        conn.finish(keep)
        return
    status, out = _answer(proxy.replicas, req)
    conn.write(wire.json_response(status, out, keep_alive=keep))
    conn.finish(keep)


def _answer(replicas: ReplicaSet, req: wire.Request) -> tuple[int, dict[str, Any]]:
    path, method = req.path.rstrip("/"), req.method
    if path == "/admin/replicas" and method == "GET":
        return 200, replicas.listing()
    if path not in ("/admin/replicas/drain", "/admin/replicas/undrain") or method != "POST":
        return 404, {"error": {"message": f"unknown admin endpoint {method} {req.path}"}}
    urls = [r.url for r in replicas]
    help_ = f'send {{"upstream": <one of {urls}>}}'
    try:
        args = json.loads(req.body) if req.body.strip() else None
    except (ValueError, RecursionError) as exc:
        return 400, {"error": {"message": f"admin body is not JSON ({exc}): {help_}"}}
    rep = replicas.find(args.get("upstream")) if isinstance(args, dict) else None
    if rep is None:
        return 400, {"error": {"message": f"unknown or missing upstream: {help_}"}}
    rep.draining = path.endswith("/drain")
    log.info(
        "upstream replica %s url=%s in_flight=%d", "drained" if rep.draining else "undrained", rep.url, rep.in_flight
    )
    return 200, replicas.describe(rep)
