"""The forward path of one model call: from an attributed request to its answer and its capture record.

A call's :class:`~clawpipe.capture.CaptureHeader` is made when it arrives and filled in as it goes: the body is
checked (size; JSON read as the upstream reads it: :mod:`~clawpipe.proxy.body`) and ``return_token_ids`` /
``logprobs`` are added (:mod:`~clawpipe.proxy.routes`); a paused proxy holds it at the gate; one upstream
replica gets it (the least loaded, then sticky per rollout: :mod:`~clawpipe.proxy.replicas`) and, only while
nothing reached the client, at most one other; the outcome becomes its captured status and answer
(:mod:`~clawpipe.proxy.outcome`); ids the upstream did not return are encoded by the retokenizer; the record
is written (:mod:`~clawpipe.proxy.segments`) before the answer's last bytes are released
(:mod:`~clawpipe.proxy.respond`): a call whose answer reached the harness is on disk.
Every call with a valid key that was read whole is captured exactly once, whatever its end (upstream error,
response over the size limit, body over the budget, shutdown, an internal error).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from typing import TYPE_CHECKING, Protocol

from clawpipe import capture
from clawpipe.capture import HEADER_FORMAT, CaptureHeader
from clawpipe.errors import ClawpipeError
from clawpipe.keys import RolloutKey
from clawpipe.proxy import coding, respond, wire
from clawpipe.proxy.call import Call
from clawpipe.proxy.checker import BodyChecker
from clawpipe.proxy.config import ProxyConfig
from clawpipe.proxy.conn import ClientConn
from clawpipe.proxy.outcome import Outcome, judge
from clawpipe.proxy.replicas import RETRY_STATUSES, ReplicaSet
from clawpipe.proxy.routes import BODYLESS_APIS, ROUTE_NAMES, ROUTES, TOKEN_APIS, allowed_methods, served_path
from clawpipe.proxy.segments import SegmentWriter
from clawpipe.proxy.upstream import Replica
from clawpipe.proxy.wire import BadRequest

if TYPE_CHECKING:
    from clawpipe.proxy.retokenize import Retokenizer

log = logging.getLogger(__name__)

TOKEN_IDS_KEY = b'"token_ids"'
# errors of the proxy's own process or host when it opens an upstream connection (no descriptor, no buffer
# or memory left): the replica is not at fault, so it is neither marked down nor swapped for another
_LOCAL_ERRNOS = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))


class OutOfDescriptors(ClawpipeError):
    """The proxy could not open an upstream connection for lack of its own resources (a 503 to the client)."""


class CallOwner(Protocol):
    """What the forward path needs from the proxy (the server is one): its settings and counters, its
    replicas and capture writer, the stamped policy version and the pause gate."""

    config: ProxyConfig
    stats: dict[str, int]
    replicas: ReplicaSet
    writer: SegmentWriter
    policy_version: int
    paused: bool

    @property
    def stopping(self) -> bool: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    async def wait_resumed(self, timeout_s: float) -> bool:
        """Wait while the proxy is paused; False when ``timeout_s`` passed first."""
        ...

    def call_began(self) -> None: ...

    def call_ended(self) -> None: ...


class CallPath:
    """Answers and captures the model calls of one proxy."""

    def __init__(self, owner: CallOwner, retokenizer: Retokenizer | None = None) -> None:
        self.owner = owner
        self.retok = retokenizer
        self.checker = BodyChecker()  # large bodies are parsed off the event loop
        self.calls: set[Call] = set()  # calls waiting for their upstream: the proxy's sweep times them out
        self._seq: dict[tuple[str, int, str], int] = {}
        self._recorded: set[str] = set()  # call ids of calls being answered whose record was submitted

    async def model_call(
        self, conn: ClientConn, req: wire.Request, att: RolloutKey, path: str, anthropic: bool
    ) -> None:
        """Answer one attributed call and capture it exactly once, also when the proxy itself fails."""
        header, api = self._new_header(req, att, path)
        call_id = header.call_id
        try:
            await self._run(conn, req, header, api, anthropic)
        except Exception as exc:  # a bug, not the call's fault: still answered, and captured exactly once
            log.exception("proxy failed on call_id=%s path=%s", call_id, req.path)
            if call_id not in self._recorded and not conn.closed:
                await self.fail(conn, req, header, 500, f"internal proxy error: {type(exc).__name__}", anthropic)
            elif call_id not in self._recorded:
                header.status, header.http_status = "http_error", 500
                header.error, header.t_end = f"internal proxy error: {exc!r}", time.time()
                await self.capture(header, req.body, b"")
            else:
                conn.write(wire.error_response(500, "internal proxy error", anthropic=anthropic, keep_alive=False))
                conn.finish(False)
        finally:
            self._recorded.discard(call_id)

    def _new_header(self, req: wire.Request, att: RolloutKey, path: str) -> tuple[CaptureHeader, str | None]:
        """The capture header of a new call (its outcome fields filled in later) and its API."""
        path, api = served_path(req.method, path)
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
            policy_version=self.owner.policy_version,
            t_start=time.time(),
            t_end=0.0,
            token_source="none",
        )
        return header, api

    async def _run(
        self, conn: ClientConn, req: wire.Request, header: CaptureHeader, api: str | None, anthropic: bool
    ) -> None:
        refused = _refusal(req, header, api, self.owner.config)
        if refused is not None:
            await self.fail(conn, req, header, *refused, anthropic)
            return
        assert api is not None  # refused above otherwise
        body, stream = req.body, False
        if api not in BODYLESS_APIS:  # a JSON body: checked here, so the upstream never sees a malformed one
            try:
                checked = await self.checker.check(api, body, req.headers.get(b"content-encoding"))
            except BadRequest as exc:
                await self.fail(conn, req, header, exc.status, str(exc), anthropic)
                return
            body, stream = checked.forwarded, checked.stream
            header.stream, header.model = stream, checked.model
            if checked.request_changes is not None:
                header.request_changes = checked.request_changes
        if self.owner.paused and not await self._through_gate(conn, req, header, anthropic):
            return
        self.owner.call_began()
        try:
            await self._forward(conn, req, header, api, body, stream, anthropic)
        finally:
            self.owner.call_ended()

    async def _through_gate(self, conn: ClientConn, req: wire.Request, header: CaptureHeader, anthropic: bool) -> bool:
        """Wait out a pause; False when the call was answered instead (timeout, shutdown, client gone)."""
        owner = self.owner
        owner.stats["paused_waits"] += 1
        if not await owner.wait_resumed(owner.config.pause_wait_s):
            owner.stats["pause_timeouts"] += 1
            msg = f"proxy paused for a weight update for over {owner.config.pause_wait_s:g} s; retry later"
            await self.fail(conn, req, header, 503, msg, anthropic)
            return False
        if owner.stopping:
            await self.fail(conn, req, header, 503, "the proxy is shutting down; retry", anthropic)
            return False
        if conn.closed:  # captured all the same: every call that reached the proxy has a record
            header.status, header.http_status, header.t_end = "cancelled", 499, time.time()
            header.error = "client disconnected while the proxy was paused"
            await self.capture(header, req.body, b"")
            return False
        header.policy_version = owner.policy_version
        return True

    async def _forward(
        self,
        conn: ClientConn,
        req: wire.Request,
        header: CaptureHeader,
        api: str,
        body: bytes,
        stream: bool,
        anthropic: bool,
    ) -> None:
        fwd_headers = b"".join(
            n + b": " + v + b"\r\n"
            for n, v in req.headers.items()
            if n in wire.FORWARDED_REQUEST_HEADERS and (api in BODYLESS_APIS or n != b"content-type")
        )
        if (
            api not in BODYLESS_APIS
        ):  # the body was read as JSON above: it goes labelled as such, whatever the client said
            # (curl -d says form-urlencoded, a string body in fetch text/plain; servers built on FastAPI, vLLM's
            # among them, then take the body for a string and refuse the call)
            fwd_headers = b"content-type: application/json\r\n" + fwd_headers
        # the rollout, for the engine to carry its own sampled ids into the rollout's next prompts; a header of
        # that name from the client is never forwarded (only FORWARDED_REQUEST_HEADERS are)
        fwd_headers += wire.rollout_header(header.run_id, header.iteration, header.rollout_id)
        path, query = header.path or "", header.query
        target = path + "?" + query if query else path
        raw = (req.method, target, fwd_headers, body if api not in BODYLESS_APIS else b"")
        call = Call(
            conn,
            stream,
            self.owner.loop,
            chunked=req.version != b"HTTP/1.0",
            limit=self.owner.config.max_response_bytes,
        )
        conn.call = call
        t_up = time.perf_counter()
        call, sent, failure = await self._send(conn, header, call, raw)
        header.upstream_ms = (time.perf_counter() - t_up) * 1000
        if failure is not None:
            await self.fail(conn, req, header, *failure, anthropic)
            return
        if self.owner.stopping and not sent:  # waited for an upstream connection until the proxy stopped
            msg = "the proxy shut down before the call reached an upstream; retry the call"
            await self.fail(conn, req, header, 503, msg, anthropic)
            return
        await self._finish(conn, req, header, api, call, anthropic)

    async def _send(
        self, conn: ClientConn, header: CaptureHeader, call: Call, raw: tuple[str, str, bytes, bytes]
    ) -> tuple[Call, bool, tuple[int, str] | None]:
        """Send the call to its replica and, when that never got it or refused it, to one other (see
        :meth:`_exchange` for when). Returns the call's sink, whether a replica got it, and (status, message)
        when none could be reached."""
        replicas, rid = self.owner.replicas, header.rollout_id
        tried: list[Replica] = []
        sent, last_error = False, ""
        rep = replicas.pick(rid)
        while rep is not None:
            tried.append(rep)
            header.upstream = rep.url
            request = rep.request_bytes(*raw)
            rep.in_flight += 1  # no await between pick and here: concurrent picks see this call's load
            try:
                sent = await self._exchange(rep, request, call, conn)
            except OutOfDescriptors as exc:  # the proxy's own limit, not the replica's fault: none is marked down
                return call, False, (503, str(exc))
            finally:
                rep.in_flight -= 1
            if self.owner.stopping:
                return call, sent, None
            replicas.report(rep, sent, call.outcome, call.status, call.error)
            if sent:
                rep.calls += 1
                replicas.bind(rid, rep)
            refused = call.outcome == "end" and call.status in RETRY_STATUSES and not call.streaming
            nxt = replicas.pick(rid, tried) if len(tried) < 2 and (not sent or refused) else None
            if sent and nxt is None:
                return call, sent, None
            if not sent:
                last_error = call.error or f"upstream {rep.url} unreachable"
            if nxt is not None:
                self.owner.stats["replica_retries"] += 1
                log.warning("call retried on another replica rollout_id=%s from=%s to=%s", rid, rep.url, nxt.url)
                if sent:  # a fresh sink: nothing of the refused answer reached the client
                    call = Call(conn, call.stream, self.owner.loop, chunked=call.chunked, limit=call.limit)
                    conn.call = call
            rep = nxt
        if not tried:
            return (
                call,
                False,
                (503, "every upstream replica is drained; undrain one (POST /admin/replicas/undrain) and retry"),
            )
        return call, False, (502, last_error or "no upstream reachable")

    async def _finish(
        self, conn: ClientConn, req: wire.Request, header: CaptureHeader, api: str, call: Call, anthropic: bool
    ) -> None:
        """Judge the upstream's answer, find the call's token ids, capture it, then release the answer."""
        body = b"".join(call.parts)
        if call.coding and call.outcome == "end" and body:  # captured and sent decoded, whatever the client accepts
            try:
                body = coding.decode(call.coding, body, call.limit)
            except ValueError as exc:
                call.outcome, call.error = "fail", str(exc)
        verdict = judge(
            Outcome(call.outcome, call.status, call.streaming, call.error, header.upstream, call.size),
            body,
            anthropic=anthropic,
        )
        response = verdict.response
        header.status, header.http_status, header.error = verdict.status, verdict.http_status, verdict.error
        header.response_partial = verdict.partial
        if verdict.status == "upstream_error":
            log.warning(
                "upstream failed rollout_id=%s upstream=%s error=%s", header.rollout_id, header.upstream, call.error
            )
        if verdict.status == "ok" and api in TOKEN_APIS:
            await self._token_source(header, api, req.body, response, call.stream)
        header.t_end = time.time()
        failure = await self.capture(header, req.body, response)
        respond.after_call(conn, call, failure, req.keep_alive, verdict.http_status, response, anthropic=anthropic)

    async def _token_source(
        self, header: CaptureHeader, api: str, request: bytes, response: bytes, stream: bool
    ) -> None:
        """Mark where the call's ids come from: the upstream's answer, or the retokenizer when it has none."""
        stats = self.owner.stats
        if TOKEN_IDS_KEY in response:
            header.token_source = "upstream"
        elif self.retok is not None:
            try:
                header.retokenized = await self.owner.loop.run_in_executor(
                    None, self.retok.retokenize, api, request, response, stream
                )
                header.token_source = "retokenized"
                stats["retokenized"] += 1
            except Exception as exc:
                log.warning("retokenization failed call_id=%s error=%s", header.call_id, exc)
                stats["retokenize_failed"] += 1
        else:
            stats["no_ids"] += 1

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
            except OSError as exc:
                if exc.errno in _LOCAL_ERRNOS:
                    raise OutOfDescriptors(
                        f"the proxy could not open a connection to {rep.url}: "
                        f"{capture.write_failure(exc, '.')}; retry shortly"
                    ) from exc
                call.error = f"upstream {rep.url} unreachable: {type(exc).__name__}: {exc}"
                return False
            except TimeoutError as exc:
                call.error = f"upstream {rep.url} unreachable: {type(exc).__name__}: {exc}"
                return False
            if conn.closed:
                rep.release(up)
                call.client_gone()
                return True
            call.up = up
            up.send(raw, call)
            self.calls.add(call)
            await call.fut
            self.calls.discard(call)
            if attempt == 0 and call.outcome == "fail" and reused and not call.parts and call.status == 0:
                # a pooled connection the upstream had closed: resend once on a fresh one
                self.owner.stats["upstream_retries"] += 1
                call.fut = self.owner.loop.create_future()
                call.outcome, call.error = "", None
                continue
            break
        return True

    async def fail(
        self, conn: ClientConn, req: wire.Request, header: CaptureHeader, status: int, msg: str, anthropic: bool
    ) -> None:
        """Answer with an error in the API's shape and capture the failed call (an answer that could not be
        recorded is a 507 saying so instead: :func:`respond.not_recorded`)."""
        body = wire.error_body(status, msg, anthropic=anthropic)
        header.http_status = status
        header.status = "upstream_error" if status in (502, 504) else "http_error"
        header.error = msg
        header.t_end = time.time()
        log.warning("call failed rollout_id=%s status=%d error=%s", header.rollout_id, status, msg)
        failure = await self.capture(header, req.body, body)
        if failure is not None:
            respond.not_recorded(conn, failure, req.keep_alive, anthropic=anthropic)
            return
        allow = ", ".join(allowed_methods(header.path or "")) if status == 405 else None
        respond.send_json(conn, status, body, req.keep_alive, allow=allow)

    async def capture(self, header: CaptureHeader, request: bytes, response: bytes) -> str | None:
        """Record one call durably and count it by status; None once it is on disk, else why it is not."""
        fut: asyncio.Future[str | None] = self.owner.loop.create_future()

        def done(exc: BaseException | None) -> None:
            if not fut.done():
                fut.set_result(None if exc is None else str(exc) or type(exc).__name__)

        self._recorded.add(header.call_id)
        try:
            self.owner.writer.submit(header, request, response, done)
        except ClawpipeError as exc:
            fut.set_result(str(exc))
        failure = await fut
        self.owner.stats[header.status or "ok"] += 1
        self.owner.stats["calls"] += 1
        if failure is not None:
            self.owner.stats["capture_failures"] += 1
            log.error("call not recorded call_id=%s rollout_id=%s: %s", header.call_id, header.rollout_id, failure)
        return failure


def _refusal(req: wire.Request, header: CaptureHeader, api: str | None, cfg: ProxyConfig) -> tuple[int, str] | None:
    """(status, message) for a call answered without forwarding: a body over the limits, an unknown endpoint."""
    if "too_large" in req.extra:
        limit = cfg.max_body_bytes
        return 413, f"request body of {req.extra['too_large']} bytes exceeds the proxy limit of {limit} bytes"
    if "over_budget" in req.extra:
        budget = cfg.max_buffered_bytes
        return 503, (
            f"the proxy is already receiving {budget >> 20} MiB of request bodies (its --max-buffered-mb); "
            "retry shortly"
        )
    if b"websocket" in req.headers.get(b"upgrade", b"").lower():  # a handshake: the client waits for a 101
        return 501, (
            f"WebSocket connections are not served ({req.method} {header.path} with Upgrade: websocket, as the "
            "Realtime API and WebSocket modes open them): the proxy captures HTTP calls; send them over HTTP "
            f"to {sorted(p for _, p in ROUTES)} (stream: true for events as they come)"
        )
    if api is None:
        allowed = allowed_methods(header.path or "")
        if allowed:  # a served path asked with another method (a GET of /v1/chat/completions)
            return 405, f"{req.method} is not allowed on {header.path}: send it as {' or '.join(allowed)}"
        return 404, f"unknown endpoint {req.method} {header.path}: the proxy serves {', '.join(ROUTE_NAMES)}"
    return None
