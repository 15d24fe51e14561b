"""The capture proxy: an OpenAI/Anthropic-compatible HTTP/1.1 front of the policy servers that records calls.

This module is its lifecycle and control: :class:`ProxyServer` binds, runs on its own event loop (in a thread,
or blocking), accepts connections, routes each request (admin, or a model call of the rollout its key names:
:mod:`~clawpipe.proxy.auth`), times out stalled calls and connections, pauses and resumes calls around a
weight update, and drains and seals on stop. A model call's way through the proxy, and the guarantee that an
answered call is on disk and every call with a valid key is captured exactly once, is
:mod:`~clawpipe.proxy.forward`; requests that cannot be framed, never finish arriving or exceed the
connection cap are answered without a record.

Module map: framing (:mod:`~clawpipe.proxy.framing`), connections (:mod:`~clawpipe.proxy.conn`), calls
(:mod:`~clawpipe.proxy.call`), request bodies (:mod:`~clawpipe.proxy.body`), upstream pool
(:mod:`~clawpipe.proxy.upstream`), outcome to captured status (:mod:`~clawpipe.proxy.outcome`), answers
(:mod:`~clawpipe.proxy.respond`), limits and settings (:mod:`~clawpipe.proxy.limits`,
:mod:`~clawpipe.proxy.config`), capture segments (:mod:`~clawpipe.proxy.segments`).

Raw ``asyncio`` protocols on uvloop (when installed), no web framework: the proxy's CPU per call is the
figure that matters (bench/proxy_overhead.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

from clawpipe.errors import ConfigError
from clawpipe.proxy import wire
from clawpipe.proxy.admin import handle_admin
from clawpipe.proxy.auth import RolloutKeys
from clawpipe.proxy.config import ProxyConfig
from clawpipe.proxy.conn import ClientConn
from clawpipe.proxy.forward import CallPath
from clawpipe.proxy.limits import MAX_POLICY_VERSION, BodyBudget, valid_policy_version
from clawpipe.proxy.loop import LoopThread
from clawpipe.proxy.replicas import ReplicaSet, handle_replica_admin
from clawpipe.proxy.segments import SegmentWriter
from clawpipe.proxy.upstream import Replica

log = logging.getLogger(__name__)

# The counters of /admin/stats: calls by captured status, and what the proxy met on the way.
STAT_NAMES = (
    "calls",
    "ok",
    "http_error",
    "upstream_error",
    "cancelled",
    "unauthorized",
    "retokenized",
    "retokenize_failed",
    "no_ids",
    "paused_waits",
    "pause_timeouts",
    "upstream_retries",
    "replica_retries",
    "capture_failures",
    "timed_out_connections",
)


class ProxyServer:
    """The capture proxy, runnable in-process (``start``/``stop``) or blocking (:func:`run_proxy`).

    Example::

        proxy = ProxyServer(upstreams=["http://127.0.0.1:8000"], capture_dir="captures", secret=b"s")
        base = proxy.start()          # "http://127.0.0.1:PORT"; harness base URL: f"{base}/r/{key}/v1"
        ...
        proxy.stop()                  # drains, seals the open segment
    """

    def __init__(self, config: ProxyConfig | None = None, /, **kwargs: Any) -> None:
        self.config = config or ProxyConfig(**kwargs)
        cfg = self.config
        if cfg.secret is None or cfg.admin_token is None:
            from clawpipe.config import get_settings

            settings = get_settings()
            cfg.secret = cfg.secret or settings.secret()
            cfg.admin_token = cfg.admin_token or settings.admin()
        self._secret: bytes = cfg.secret if isinstance(cfg.secret, bytes) else str(cfg.secret).encode()
        self._admin = b"Bearer " + str(cfg.admin_token).encode()
        self.instance = cfg.instance or f"p{os.getpid()}-{secrets.token_hex(3)}"
        self.policy_version = int(cfg.policy_version)
        self.body_budget = BodyBudget(cfg.max_buffered_bytes)
        self.paused = False
        self.in_flight = 0
        self.port = cfg.port
        self.stats: dict[str, int] = dict.fromkeys(STAT_NAMES, 0)
        self.keys = RolloutKeys(self._secret)
        self._conns: set[ClientConn] = set()
        self._handlers: set[asyncio.Task[None]] = set()  # one per request being answered
        self._stopping = False
        retok = None
        if cfg.tokenizer_dir:
            from clawpipe.proxy.retokenize import Retokenizer

            retok = Retokenizer(cfg.tokenizer_dir)
        self.calls = CallPath(self, retok)
        self.writer = SegmentWriter(
            cfg.capture_dir,
            instance=self.instance,
            max_bytes=cfg.segment_max_bytes,
            max_age_s=cfg.segment_max_age_s,
            fsync=cfg.fsync,
        )
        self._loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._replicas: list[Replica] = []
        self.replicas = ReplicaSet([], time.monotonic)
        self._server: asyncio.AbstractServer | None = None
        self._runner = LoopThread(f"proxy-{self.instance}")
        self._stop_event: asyncio.Event | None = None
        self._stop_drain_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def __enter__(self) -> ProxyServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- lifecycle -----------------------------------------------------------------------------------
    async def open(self) -> str:
        """Bind, recover old segments and start the capture writer, on the running loop; return the URL."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        cfg = self.config
        self._replicas = [
            Replica(
                u,
                loop,
                connect_timeout_s=cfg.connect_timeout_s,
                api_key=cfg.upstream_api_key,
                max_conns=cfg.max_upstream_conns,
            )
            for u in cfg.upstreams
        ]
        self.replicas = ReplicaSet(self._replicas, loop.time, cfg.replica_backoff_s)
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self._stop_event = asyncio.Event()
        self.writer.start(loop.call_soon_threadsafe)
        try:
            self._server = await loop.create_server(
                lambda: ClientConn(self), cfg.host, cfg.port, backlog=2048, reuse_address=True
            )
        except BaseException:  # a port in use, say: the writer started for this proxy stops with it
            await loop.run_in_executor(None, self.writer.close)
            raise
        self.port = self._server.sockets[0].getsockname()[1]
        self._tick = min(1.0, cfg.upstream_timeout_s / 4, cfg.header_timeout_s / 4, cfg.idle_timeout_s / 4)
        loop.call_later(self._tick, self._check_timeouts)
        log.info("proxy listening url=%s capture_dir=%s instance=%s", self.url, cfg.capture_dir, self.instance)
        return self.url

    async def close(self, drain_timeout_s: float | None = None) -> None:
        """Stop accepting, let in-flight calls finish (bounded), then end the rest: each is captured as
        cancelled and its client told (503, or an unterminated stream); seal the open segment."""
        self._stopping = True
        if self._server is not None:
            self._server.close()
        timeout = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drained.wait(), timeout)
        for call in list(self.calls.calls):
            call.shut_down()
        for rep in self._replicas:
            rep.stop_waiting()  # calls waiting for an upstream connection answer 503 and are captured
        self._resumed.set()  # calls waiting out a pause answer 503 and are captured
        if self._handlers:
            await asyncio.wait(set(self._handlers), timeout=10)
        for conn in list(self._conns):
            conn.close()
        for rep in self._replicas:
            rep.close()
        await self.calls.checker.close()
        await self._loop.run_in_executor(None, self.writer.close)
        log.info("proxy stopped instance=%s sealed=%s", self.instance, self.writer.sealed[-3:])

    def _track(self, task: asyncio.Task[None]) -> None:
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    # --- what a ClientConn needs from its owner (conn.ConnOwner) ---------------------------------------

    def now(self) -> float:
        return self._loop.time()

    def call_later(self, delay: float, fn: Callable[[], object]) -> None:
        self._loop.call_later(delay, fn)

    def admit(self, conn: ClientConn) -> bool:
        if len(self._conns) >= self.config.max_connections:
            return False
        self._conns.add(conn)
        return True

    def forget(self, conn: ClientConn) -> None:
        self._conns.discard(conn)

    def serve(self, conn: ClientConn, req: wire.Request) -> None:
        self._track(self._loop.create_task(self._handle(conn, req)))

    # --- what the forward path needs from its owner (forward.CallOwner) ---------------------------------

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    async def wait_resumed(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._resumed.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def call_began(self) -> None:
        self.in_flight += 1
        self._drained.clear()

    def call_ended(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._drained.set()

    # --- running -------------------------------------------------------------------------------------
    async def serve_until_stopped(self, ready: Callable[[], None] | None = None) -> None:
        """Open, call ``ready``, serve until :meth:`request_stop`, then close (drain, seal)."""
        await self.open()
        if ready is not None:
            ready()
        assert self._stop_event is not None
        await self._stop_event.wait()
        await self.close(self._stop_drain_s)

    def request_stop(self) -> None:
        """Ask a running proxy to stop (thread-safe)."""
        if self._loop is not None and self._stop_event is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop_event.set)

    def start(self) -> str:
        """Run the proxy on its own event loop in a background thread; return its base URL."""
        self._runner.start(self.serve_until_stopped, 30)
        return self.url

    def stop(self, drain_timeout_s: float | None = None) -> None:
        """Stop a proxy started with :meth:`start`: in-flight calls get ``drain_timeout_s`` (default the
        config's) to finish, then connections close and the open segment is sealed. Idempotent."""
        if not self._runner.running:
            return
        if drain_timeout_s is not None:
            self._stop_drain_s = drain_timeout_s
        self.request_stop()
        self._runner.join((self._stop_drain_s or self.config.drain_timeout_s) + 30)

    # --- request handling ----------------------------------------------------------------------------
    async def _handle(self, conn: ClientConn, req: wire.Request) -> None:
        try:
            if req.path.startswith("/admin/replicas"):
                await handle_replica_admin(self, conn, req)
                return
            if req.path.startswith("/admin/"):
                await handle_admin(self, conn, req)
                return
            if req.method == "CONNECT":  # a client given the proxy as HTTPS_PROXY: it asks for a tunnel
                msg = (
                    f"the clawpipe proxy is no forward proxy and opens no tunnel (CONNECT {req.target[:100]}): "
                    "unset HTTPS_PROXY for this client and give it the base URL http://<proxy>/r/<key>/v1 instead"
                )
                conn.write(wire.error_response(501, msg, anthropic=None, keep_alive=False))
                conn.finish(False)
                return
            att, path = self.keys.authorize(req)
            anthropic = path.endswith(("/messages", "/count_tokens")) or b"anthropic-version" in req.headers
            if att is None:
                self.stats["unauthorized"] += 1
                conn.write(
                    wire.error_response(
                        401,
                        "missing or invalid rollout key: use the base URL /r/<key>/v1 or the key as API key",
                        anthropic=anthropic,
                        keep_alive=req.keep_alive,
                    )
                )
                conn.finish(req.keep_alive)
                return
            await self.calls.model_call(conn, req, att, path, anthropic)
        except Exception:
            log.exception("proxy handler failed path=%s", req.path)
            conn.write(wire.error_response(500, "internal proxy error", anthropic=False, keep_alive=False))
            conn.finish(False)

    def _check_timeouts(self) -> None:
        now = self._loop.time()
        limit = self.config.upstream_timeout_s
        for call in list(self.calls.calls):
            up = call.up
            if up is not None and now - up.last_activity > limit:
                call.timed_out(limit)
        for conn in list(self._conns):
            if conn.time_out(now):
                self.stats["timed_out_connections"] += 1
        if self._server is not None and self._server.is_serving():
            self._loop.call_later(self._tick, self._check_timeouts)

    # --- admin ---------------------------------------------------------------------------------------
    # --- control (on the proxy's loop; the sync wrappers below work from any thread) -----------------
    def is_admin(self, authorization: bytes) -> bool:
        return hmac.compare_digest(authorization, self._admin)

    def health(self) -> dict[str, Any]:
        """``status`` is ``ok``, or ``capture_failing`` while call records cannot be written (``capture`` says why
        and since when; such calls are answered 507, not as captured)."""
        capture = self.writer.health()
        return {
            "status": "ok" if capture["ok"] else "capture_failing",
            "capture": capture,
            "paused": self.paused,
            "policy_version": self.policy_version,
            "in_flight": self.in_flight,
            "upstreams": [r.url for r in self._replicas],
            "instance": self.instance,
        }

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Whether a call sent now can be captured and forwarded: capture writes succeed and at least one
        upstream is not backing off after failures; ``reasons`` names what is not."""
        capture = self.writer.health()
        states = {r.url: self.replicas.state(r) for r in self.replicas}
        reasons = []
        if not capture["ok"]:
            reasons.append(f"capture failing: {capture.get('error')}")
        if states and "up" not in states.values():
            reasons.append("every upstream is down (backing off after failed calls): " + ", ".join(states))
        return not reasons, {"ready": not reasons, "reasons": reasons, "upstreams": states}

    async def pause_calls(self, wait_s: float) -> dict[str, Any]:
        """New calls wait at the gate; returns once in-flight calls drained (or ``wait_s`` passed)."""
        self.paused = True
        self._resumed.clear()
        drained = True
        try:
            await asyncio.wait_for(self._drained.wait(), wait_s)
        except TimeoutError:
            drained = False
        log.info("proxy paused drained=%s in_flight=%d", drained, self.in_flight)
        return {"paused": True, "drained": drained, "in_flight": self.in_flight}

    def resume_calls(self, policy_version: int | None = None) -> dict[str, Any]:
        """Set the stamped version (when given) and let waiting calls through."""
        if policy_version is not None:
            if not valid_policy_version(policy_version):
                raise ConfigError(f"policy_version must be an integer in [0, {MAX_POLICY_VERSION}]")
            self.policy_version = policy_version
        self.paused = False
        self._resumed.set()
        log.info("proxy resumed policy_version=%d", self.policy_version)
        return {"paused": False, "policy_version": self.policy_version}

    def pause(self, wait_s: float | None = None) -> dict[str, Any]:
        """Thread-safe :meth:`pause_calls` for a proxy started with :meth:`start`."""
        wait = self.config.drain_timeout_s if wait_s is None else wait_s
        return asyncio.run_coroutine_threadsafe(self.pause_calls(wait), self._loop).result(wait + 10)

    def resume(self, policy_version: int | None = None) -> dict[str, Any]:
        """Thread-safe :meth:`resume_calls` for a proxy started with :meth:`start`."""

        async def _resume() -> dict[str, Any]:
            return self.resume_calls(policy_version)

        return asyncio.run_coroutine_threadsafe(_resume(), self._loop).result(10)

    def snapshot_stats(self) -> dict[str, Any]:
        """Counters, in-flight calls, capture writer figures and the process's RSS."""
        out: dict[str, Any] = dict(self.stats)
        out.update(
            in_flight=self.in_flight,
            paused=self.paused,
            policy_version=self.policy_version,
            records=self.writer.records,
            batches=self.writer.batches,
            bytes_written=self.writer.bytes_written,
            segment=self.writer.current_segment,
            sealed_segments=len(self.writer.sealed),
            rss_bytes=_rss_bytes(),
            connections=len(self._conns),
            buffered_body_bytes=self.body_budget.used,
            bodies_checked_in_worker=self.calls.checker.offloaded,
            body_checker_restarts=self.calls.checker.worker_restarts,
            upstream_connections={r.url: r.open for r in self._replicas},
            upstream_waiting={r.url: r.waiting for r in self._replicas},
        )
        return out


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
