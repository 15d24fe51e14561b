"""The capture proxy: an OpenAI/Anthropic-compatible HTTP/1.1 front of the policy servers that records calls.

Each call is attributed to its rollout by a key (:mod:`clawpipe.keys`) in the path (``/r/<key>/v1/...``)
or as the bearer / ``x-api-key`` token; it is forwarded to one upstream replica (the least loaded, then sticky
per rollout: :mod:`~clawpipe.proxy.replicas`) with ``return_token_ids``/``logprobs`` added, streamed back
byte for byte, and appended to a capture segment (:mod:`clawpipe.proxy.segments`). Durability guarantee: the
response of a non-streamed call, and the final bytes of a streamed one (the chunk holding its end marker and
the chunked terminator), are released to the harness only after the call's record is fsynced: a call whose
response reached the harness is on disk.
Every call with a valid key that was read whole is captured exactly once, whatever its end (upstream error,
response over the size limit, body over the budget, shutdown, an internal error); requests that cannot be
framed, that never finish arriving, or that exceed the connection cap are answered without a record.

Module map: framing (:mod:`~clawpipe.proxy.framing`), connections (:mod:`~clawpipe.proxy.conn`), calls
(:mod:`~clawpipe.proxy.call`), upstream pool (:mod:`~clawpipe.proxy.upstream`), outcome to captured status
(:mod:`~clawpipe.proxy.outcome`), answers (:mod:`~clawpipe.proxy.respond`), limits and settings
(:mod:`~clawpipe.proxy.limits`, :mod:`~clawpipe.proxy.config`).

Raw ``asyncio`` protocols on uvloop (when installed), no web framework: the proxy's CPU per call is the
figure that matters (bench/proxy_overhead.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from clawpipe.capture import HEADER_FORMAT, CaptureHeader
from clawpipe.errors import ClawpipeError, ConfigError, KeyVerificationError
from clawpipe.keys import RolloutKey, verify_key
from clawpipe.proxy import respond, wire
from clawpipe.proxy.admin import handle_admin
from clawpipe.proxy.call import Call
from clawpipe.proxy.config import ProxyConfig
from clawpipe.proxy.conn import ClientConn
from clawpipe.proxy.limits import MAX_POLICY_VERSION, BodyBudget, valid_policy_version
from clawpipe.proxy.outcome import Outcome, judge
from clawpipe.proxy.replicas import RETRY_STATUSES, ReplicaSet, handle_replica_admin
from clawpipe.proxy.routes import ROUTES, TOKEN_APIS, prepare_body
from clawpipe.proxy.segments import SegmentWriter
from clawpipe.proxy.upstream import Replica

log = logging.getLogger(__name__)

TOKEN_IDS_KEY = b'"token_ids"'


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
        self.stats: dict[str, int] = {
            "calls": 0,
            "ok": 0,
            "http_error": 0,
            "upstream_error": 0,
            "cancelled": 0,
            "unauthorized": 0,
            "retokenized": 0,
            "retokenize_failed": 0,
            "no_ids": 0,
            "paused_waits": 0,
            "pause_timeouts": 0,
            "upstream_retries": 0,
            "replica_retries": 0,
            "capture_failures": 0,
            "timed_out_connections": 0,
        }
        self._keys: dict[str, RolloutKey] = {}
        self._seq: dict[tuple[str, int, str], int] = {}
        self._conns: set[ClientConn] = set()
        self._calls: set[Call] = set()
        self._recorded: set[str] = set()  # call ids of calls being answered whose record was submitted
        self._handlers: set[asyncio.Task[None]] = set()  # one per request being answered
        self._stopping = False
        self._retok: Any = None
        if cfg.tokenizer_dir:
            from clawpipe.proxy.retokenize import Retokenizer

            self._retok = Retokenizer(cfg.tokenizer_dir)
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
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
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
        self._server = await loop.create_server(
            lambda: ClientConn(self), cfg.host, cfg.port, backlog=2048, reuse_address=True
        )
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
        for call in list(self._calls):
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

    async def serve_until_stopped(self) -> None:
        await self.open()
        assert self._stop_event is not None
        await self._stop_event.wait()
        await self.close()

    def request_stop(self) -> None:
        """Ask a running proxy to stop (thread-safe)."""
        if self._loop is not None and self._stop_event is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop_event.set)

    def start(self) -> str:
        """Run the proxy on its own event loop in a background thread; return its base URL."""
        self._thread = threading.Thread(target=self._thread_main, name=f"proxy-{self.instance}", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._start_error is not None:
            raise self._start_error
        if not self._ready.is_set():
            raise ClawpipeError("proxy did not start within 30 s")
        return self.url

    def stop(self, drain_timeout_s: float | None = None) -> None:
        """Stop a proxy started with :meth:`start`: in-flight calls get ``drain_timeout_s`` (default the
        config's) to finish, then connections close and the open segment is sealed. Idempotent."""
        if self._thread is None:
            return
        if drain_timeout_s is not None:
            self._stop_drain_s = drain_timeout_s
        self.request_stop()
        self._thread.join((self._stop_drain_s or self.config.drain_timeout_s) + 30)
        self._thread = None

    def _thread_main(self) -> None:
        loop = new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self.open())
        except BaseException as exc:
            self._start_error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            assert self._stop_event is not None
            loop.run_until_complete(self._stop_event.wait())
            loop.run_until_complete(self.close(self._stop_drain_s))
        finally:
            loop.close()

    # --- request handling ----------------------------------------------------------------------------
    def _authorize(self, req: wire.Request) -> tuple[RolloutKey | None, str]:
        """(attribution or None, path after the rollout prefix)."""
        path = req.path
        if path.startswith("/r/"):
            slash = path.find("/", 3)
            if slash < 0:
                return None, path
            return self._verify(path[3:slash]), path[slash:]
        # a bearer token or x-api-key: the first that is a rollout key (a harness may carry a stray token too)
        auth = req.headers.get(b"authorization")
        if auth is not None and auth[:7].lower() == b"bearer ":
            att = self._verify(auth[7:].strip().decode("latin-1"))
            if att is not None:
                return att, path
        xkey = req.headers.get(b"x-api-key")
        return (self._verify(xkey.strip().decode("latin-1")) if xkey is not None else None), path

    def _verify(self, key: str) -> RolloutKey | None:
        if not key:
            return None
        hit = self._keys.get(key)
        if hit is not None:
            return hit
        try:
            att = verify_key(self._secret, key)
        except KeyVerificationError:
            return None
        if len(self._keys) > 200_000:
            self._keys.clear()
        self._keys[key] = att
        return att

    async def _handle(self, conn: ClientConn, req: wire.Request) -> None:
        try:
            if req.path.startswith("/admin/replicas"):
                await handle_replica_admin(self, conn, req)
                return
            if req.path.startswith("/admin/"):
                await handle_admin(self, conn, req)
                return
            att, path = self._authorize(req)
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
            await self._model_call(conn, req, att, path, anthropic)
        except Exception:
            log.exception("proxy handler failed path=%s", req.path)
            conn.write(wire.error_response(500, "internal proxy error", anthropic=False, keep_alive=False))
            conn.finish(False)

    def _new_header(self, req: wire.Request, att: RolloutKey, path: str) -> tuple[CaptureHeader, str | None]:
        """The capture header of a new call (its outcome fields filled in later) and its API."""
        api = ROUTES.get((req.method, path))
        if api is None and not path.startswith("/v1/"):  # a base URL given without /v1
            api = ROUTES.get((req.method, "/v1" + path))
            if api is not None:
                path = "/v1" + path
        rkey = (att.run_id, att.iteration, att.rollout_id)
        seq = self._seq.get(rkey, -1) + 1
        if seq == 0 and len(self._seq) > 500_000:
            self._seq.clear()
        self._seq[rkey] = seq
        header = CaptureHeader(
            format=HEADER_FORMAT,
            call_id=os.urandom(16).hex(),
            run_id=att.run_id,
            iteration=att.iteration,
            rollout_id=att.rollout_id,
            seq=seq,
            api=api or "unknown",
            method=req.method,
            path=path,
            query=req.target.partition("?")[2],
            http_status=0,
            status="ok",
            policy_version=self.policy_version,
            t_start=time.time(),
            t_end=0.0,
            token_source="none",
        )
        return header, api

    async def _model_call(
        self, conn: ClientConn, req: wire.Request, att: RolloutKey, path: str, anthropic: bool
    ) -> None:
        header, api = self._new_header(req, att, path)
        call_id = header.call_id
        try:
            await self._run_call(conn, req, header, api, anthropic)
        except Exception as exc:  # a bug, not the call's fault: still answered, and captured exactly once
            log.exception("proxy failed on call_id=%s path=%s", call_id, req.path)
            if call_id not in self._recorded and not conn.closed:
                await self._fail(conn, req, header, 500, f"internal proxy error: {type(exc).__name__}", anthropic)
            elif call_id not in self._recorded:
                header.status, header.http_status = "http_error", 500
                header.error, header.t_end = f"internal proxy error: {exc!r}", time.time()
                await self._capture(header, req.body, b"")
            else:
                conn.write(wire.error_response(500, "internal proxy error", anthropic=anthropic, keep_alive=False))
                conn.finish(False)
        finally:
            self._recorded.discard(call_id)

    async def _run_call(
        self, conn: ClientConn, req: wire.Request, header: CaptureHeader, api: str | None, anthropic: bool
    ) -> None:
        path = header.path or ""  # always set by _new_header
        if "too_large" in req.extra:
            limit = self.config.max_body_bytes
            msg = f"request body of {req.extra['too_large']} bytes exceeds the proxy limit of {limit} bytes"
            await self._fail(conn, req, header, 413, msg, anthropic)
            return
        if "over_budget" in req.extra:
            budget = self.config.max_buffered_bytes
            msg = (
                f"the proxy is already receiving {budget >> 20} MiB of request bodies (its --max-buffered-mb); "
                "retry shortly"
            )
            await self._fail(conn, req, header, 503, msg, anthropic)
            return
        if api is None:
            msg = f"unknown endpoint {req.method} {path}: the proxy serves {sorted(p for _, p in ROUTES)}"
            await self._fail(conn, req, header, 404, msg, anthropic)
            return
        body = req.body
        stream = False
        if api != "models":  # a JSON body: checked here, so the upstream never sees a malformed one
            try:
                obj = json.loads(body)
            except (ValueError, RecursionError) as exc:
                await self._fail(conn, req, header, 400, f"request body is not valid JSON: {exc}", anthropic)
                return
            if not isinstance(obj, dict):
                await self._fail(conn, req, header, 400, "request body must be a JSON object", anthropic)
                return
            stream = obj.get("stream") is True
            header.stream = stream
            model = obj.get("model")
            header.model = model if isinstance(model, str) else None
            if api in TOKEN_APIS:
                body, changes = prepare_body(api, body, obj)
                if changes:
                    header.request_changes = msgspec.Raw(msgspec.json.encode(changes))
        if self.paused:
            self.stats["paused_waits"] += 1
            try:
                await asyncio.wait_for(self._resumed.wait(), self.config.pause_wait_s)
            except TimeoutError:
                self.stats["pause_timeouts"] += 1
                msg = f"proxy paused for a weight update for over {self.config.pause_wait_s:g} s; retry later"
                await self._fail(conn, req, header, 503, msg, anthropic)
                return
            if self._stopping:
                await self._fail(conn, req, header, 503, "the proxy is shutting down; retry", anthropic)
                return
            if conn.closed:  # captured all the same: every call that reached the proxy has a record
                header.status, header.http_status, header.t_end = "cancelled", 499, time.time()
                header.error = "client disconnected while the proxy was paused"
                await self._capture(header, req.body, b"")
                return
            header.policy_version = self.policy_version
        self.in_flight += 1
        self._drained.clear()
        try:
            await self._forward(conn, req, header, api, path, body, stream, anthropic)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._drained.set()

    async def _forward(
        self,
        conn: ClientConn,
        req: wire.Request,
        header: CaptureHeader,
        api: str,
        path: str,
        body: bytes,
        stream: bool,
        anthropic: bool,
    ) -> None:
        loop = self._loop
        fwd_headers = b"".join(
            n + b": " + v + b"\r\n" for n, v in req.headers.items() if n in wire.FORWARDED_REQUEST_HEADERS
        )
        # the rollout, for the engine to carry its own sampled ids into the rollout's next prompts; a header of
        # that name from the client is never forwarded (only FORWARDED_REQUEST_HEADERS are)
        fwd_headers += wire.rollout_header(header.run_id, header.iteration, header.rollout_id)
        query = header.query
        target = path + "?" + query if query else path
        call = Call(conn, stream, loop, chunked=req.version != b"HTTP/1.0", limit=self.config.max_response_bytes)
        conn.call = call
        t_up = time.perf_counter()
        last_error = ""
        rid = header.rollout_id
        tried: list[Replica] = []
        sent = False
        rep = self.replicas.pick(rid)
        while rep is not None:  # the first replica, then at most one other (see _exchange for when)
            tried.append(rep)
            header.upstream = rep.url
            raw = rep.request_bytes(req.method, target, fwd_headers, body if api != "models" else b"")
            rep.in_flight += 1  # no await between pick and here: concurrent picks see this call's load
            try:
                sent = await self._exchange(rep, raw, call, conn)
            finally:
                rep.in_flight -= 1
            if self._stopping:
                break
            self.replicas.report(rep, sent, call.outcome, call.status, call.error)
            if sent:
                rep.calls += 1
                self.replicas.bind(rid, rep)
            refused = call.outcome == "end" and call.status in RETRY_STATUSES and not call.streaming
            nxt = self.replicas.pick(rid, tried) if len(tried) < 2 and (not sent or refused) else None
            if sent and nxt is None:
                break
            if not sent:
                last_error = call.error or f"upstream {rep.url} unreachable"
            if nxt is not None:
                self.stats["replica_retries"] += 1
                log.warning("call retried on another replica rollout_id=%s from=%s to=%s", rid, rep.url, nxt.url)
                if sent:  # a fresh sink: nothing of the refused answer reached the client
                    call = Call(conn, stream, loop, chunked=req.version != b"HTTP/1.0", limit=call.limit)
                    conn.call = call
            rep = nxt
        else:
            header.upstream_ms = (time.perf_counter() - t_up) * 1000
            if not tried:
                msg = "every upstream replica is drained; undrain one (POST /admin/replicas/undrain) and retry"
                await self._fail(conn, req, header, 503, msg, anthropic)
            else:
                await self._fail(conn, req, header, 502, last_error or "no upstream reachable", anthropic)
            return
        if self._stopping and not sent:  # waited for an upstream connection until the proxy stopped
            header.upstream_ms = (time.perf_counter() - t_up) * 1000
            msg = "the proxy shut down before the call reached an upstream; retry the call"
            await self._fail(conn, req, header, 503, msg, anthropic)
            return
        header.upstream_ms = (time.perf_counter() - t_up) * 1000
        outcome = call.outcome
        verdict = judge(
            Outcome(outcome, call.status, call.streaming, call.error, header.upstream, call.size),
            b"".join(call.parts),
            anthropic=anthropic,
        )
        response = verdict.response
        header.status, header.http_status, header.error = verdict.status, verdict.http_status, verdict.error
        header.response_partial = verdict.partial
        if verdict.status == "upstream_error":
            log.warning(
                "upstream failed rollout_id=%s upstream=%s error=%s",
                header.rollout_id,
                header.upstream,
                call.error,
            )
        if verdict.status == "ok" and api in TOKEN_APIS:
            if TOKEN_IDS_KEY in response:
                header.token_source = "upstream"
            elif self._retok is not None:
                try:
                    header.retokenized = await loop.run_in_executor(
                        None, self._retok.retokenize, api, req.body, response, stream
                    )
                    header.token_source = "retokenized"
                    self.stats["retokenized"] += 1
                except Exception as exc:
                    log.warning("retokenization failed call_id=%s error=%s", header.call_id, exc)
                    self.stats["retokenize_failed"] += 1
            else:
                self.stats["no_ids"] += 1
        header.t_end = time.time()
        ok = await self._capture(header, req.body, response)
        respond.after_call(conn, call, ok, req.keep_alive, verdict.http_status, response, anthropic=anthropic)

    async def _exchange(self, rep: Replica, raw: bytes, call: Call, conn: ClientConn) -> bool:
        """Send one request to a replica; False when it was never sent (no connection could be had).

        When a call is sent again, never a call the upstream may have executed:
        - here, on the same replica, once: a pooled keep-alive connection the upstream had already closed
          (the write met a closed socket: the connection ends with no response byte);
        - by the caller, on one other replica, once, and only while nothing reached the client: when this
          returns False (no connection: the request never left the proxy), or when the replica answered 502
          or 503 in its response head (it did not serve the call; its error body is dropped). Any other end
          (a connection broken after the request was sent, a timeout, any other status) is final.
        """
        for attempt in range(2):
            try:
                up, reused = await rep.acquire()
            except (OSError, TimeoutError) as exc:
                call.error = f"upstream {rep.url} unreachable: {type(exc).__name__}: {exc}"
                return False
            if conn.closed:
                rep.release(up)
                call.client_gone()
                return True
            call.up = up
            up.send(raw, call)
            self._calls.add(call)
            await call.fut
            self._calls.discard(call)
            if attempt == 0 and call.outcome == "fail" and reused and not call.parts and call.status == 0:
                # a pooled connection the upstream had closed: resend once on a fresh one
                self.stats["upstream_retries"] += 1
                call.fut = self._loop.create_future()
                call.outcome, call.error = "", None
                continue
            break
        return True

    async def _fail(
        self, conn: ClientConn, req: wire.Request, header: CaptureHeader, status: int, msg: str, anthropic: bool
    ) -> None:
        """Answer with an error in the API's shape and capture the failed call."""
        body = wire.error_body(status, msg, anthropic=anthropic)
        header.http_status = status
        header.status = "upstream_error" if status in (502, 504) else "http_error"
        header.error = msg
        header.t_end = time.time()
        log.warning("call failed rollout_id=%s status=%d error=%s", header.rollout_id, status, msg)
        await self._capture(header, req.body, body)
        respond.send_json(conn, status, body, req.keep_alive)

    async def _capture(self, header: CaptureHeader, request: bytes, response: bytes) -> bool:
        """Record one call durably and count it by status; False when the record could not be written."""
        fut: asyncio.Future[bool] = self._loop.create_future()

        def done(exc: BaseException | None) -> None:
            if not fut.done():
                fut.set_result(exc is None)

        self._recorded.add(header.call_id)
        try:
            self.writer.submit(header, request, response, done)
        except ClawpipeError:
            fut.set_result(False)
        ok = await fut
        self.stats[header.status or "ok"] += 1
        self.stats["calls"] += 1
        return ok

    def _check_timeouts(self) -> None:
        now = self._loop.time()
        limit = self.config.upstream_timeout_s
        for call in list(self._calls):
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
        return {
            "status": "ok",
            "paused": self.paused,
            "policy_version": self.policy_version,
            "in_flight": self.in_flight,
            "upstreams": [r.url for r in self._replicas],
            "instance": self.instance,
        }

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


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when installed (lower CPU per call), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
