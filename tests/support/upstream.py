"""The one scripted model server of the tests: vLLM-shaped, speaking the four APIs (clawpipe/apis).

Serves ``POST .../v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/messages`` (stream and
not; any path prefix, e.g. a harness's ``/r/<key>``), ``GET .../models`` and ``/health``, and ``HEAD`` on
loopback, from a raw-asyncio server in a background thread. It stands behind the proxy in the proxy, lake
and harness tests, and in front of the real CLI harnesses. Bodies and events per API and the byte-level
token ids are in :mod:`tests.support.dialects`; answers in :mod:`tests.support.scripts`. Ids are returned
only when the request asks (``return_token_ids``, as the proxy does), logprobs when ``logprobs`` is set.

Usage::

    from tests.support.upstream import ScriptedUpstream, say, tool_call, shell_then_reply

    with ScriptedUpstream([tool_call("get_weather", {"city": "Paris"}), say("It is sunny.")]) as up:
        up.url                    # "http://127.0.0.1:PORT" (no /v1)
        ...                       # each request takes the next scripted answer; then `default` is used
        up.requests               # [SeenRequest(method, path, query, headers, body)], .json() / .params parse
        up.answers                # per model request: kind (tool | text), name, args, prompt and completion ids
        up.ids = False            # knobs, settable any time: ids, delay_s, chunk_delay_s,
        up.error_status = 500     #   error_status (answer every call with this error), hang (never answer),
                                  #   cut_after_events (drop the connection mid-stream after N SSE events)
    ScriptedUpstream(default=shell_then_reply(COMMAND))  # a CLI harness: call its shell tool, then reply
    # stop() on exit; or up = ScriptedUpstream().start(); ...; up.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

from tests.support.dialects import Reply, prompt_ids, render_call, render_prompt
from tests.support.scripts import Answer, Decide, ShellTool, find_shell_tool, say, shell_then_reply, tool_call

__all__ = [
    "Answer",
    "ScriptedUpstream",
    "SeenRequest",
    "ShellTool",
    "api_of",
    "find_shell_tool",
    "prompt_ids",
    "render_call",
    "render_prompt",
    "say",
    "shell_then_reply",
    "tool_call",
]

_ROUTES = (
    ("/chat/completions", "chat"),
    ("/completions", "completions"),
    ("/responses", "responses"),
    ("/messages", "messages"),
)


def api_of(path: str) -> str | None:
    """The API a request path speaks, whatever prefix stands before ``/v1``."""
    return next((api for suffix, api in _ROUTES if path.endswith(suffix)), None)


@dataclass
class SeenRequest:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    @property
    def params(self) -> dict[str, str]:
        """The query string as a dict."""
        return dict(parse_qsl(self.query))


class ScriptedUpstream:
    """The scripted server (see module docstring). Thread-safe to reconfigure between calls."""

    def __init__(
        self,
        script: Iterable[Answer] = (),
        *,
        default: Answer | Decide | None = None,
        model: str = "mock-model",
        ids: bool = True,
        delay_s: float = 0.0,
        chunk_delay_s: float = 0.0,
        chunk_chars: int = 4,
        error_status: int | None = None,
        hang: bool = False,
        cut_after_events: int | None = None,
        policy_version: int = 0,
    ) -> None:
        self.script: list[Answer] = list(script)
        self.default: Answer | Decide = default or say("ok")
        self.model = model
        self.ids = ids
        self.delay_s = delay_s
        self.chunk_delay_s = chunk_delay_s
        self.chunk_chars = chunk_chars
        self.error_status = error_status
        self.hang = hang
        self.cut_after_events = cut_after_events
        self.policy_version = policy_version
        self.requests: list[SeenRequest] = []
        self.answers: list[dict[str, Any]] = []  # per model request, in arrival order
        self.cancelled = 0  # streams the client (the proxy) cut short
        self.port = 0
        self._lock = threading.Lock()
        self._counter = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._writers: set[asyncio.StreamWriter] = set()

    # --- API ------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def model_requests(self) -> list[SeenRequest]:
        """The requests to the four APIs' routes, in arrival order."""
        with self._lock:
            return [r for r in self.requests if r.method == "POST" and api_of(r.path)]

    def push(self, *answers: Answer) -> None:
        with self._lock:
            self.script.extend(answers)

    def start(self) -> ScriptedUpstream:
        self._thread = threading.Thread(target=self._main, name="scripted-upstream", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("scripted upstream did not start")
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return

        def _shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            for task in asyncio.all_tasks(loop):
                task.cancel()

        loop.call_soon_threadsafe(_shutdown)
        if self._thread is not None:
            self._thread.join(10)
        self._loop = None

    def __enter__(self) -> ScriptedUpstream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- server ---------------------------------------------------------------------------------------
    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)

        async def boot() -> None:
            self._server = await asyncio.start_server(self._conn, "127.0.0.1", 0, backlog=512)
            self.port = self._server.sockets[0].getsockname()[1]

        loop.run_until_complete(boot())
        self._ready.set()
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(self._server.serve_forever())  # type: ignore[union-attr]
        with contextlib.suppress(Exception):
            loop.run_until_complete(asyncio.sleep(0))
        loop.close()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                n = int(headers.get("content-length", "0"))
                body = await reader.readexactly(n) if n else b""
                path, _, query = target.partition("?")
                self.requests.append(SeenRequest(method, path, query, headers, body))
                keep = await self._respond(writer, method, path, body)
                if not keep:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _respond(self, writer: asyncio.StreamWriter, method: str, path: str, body: bytes) -> bool:
        if self.hang:
            await asyncio.sleep(3600)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if method == "HEAD":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            return True
        if method == "GET" and path.endswith("/models"):
            return await self._send_json(
                writer,
                200,
                {
                    "object": "list",
                    "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "clawpipe"}],
                },
            )
        if method == "GET" and path.endswith("/health"):
            return await self._send_json(
                writer, 200, {"status": "ok", "policy_version": self.policy_version, "model": self.model}
            )
        api = api_of(path)
        if method != "POST" or api is None:
            return await self._send_json(writer, 404, {"error": {"message": f"no route {method} {path}"}})
        if self.error_status:
            msg = {"error": {"message": "scripted upstream error", "type": "server_error", "code": self.error_status}}
            return await self._send_json(writer, self.error_status, msg)
        try:
            req = json.loads(body)
        except ValueError:
            return await self._send_json(writer, 400, {"error": {"message": "invalid JSON"}})
        if not isinstance(req, dict):
            return await self._send_json(writer, 400, {"error": {"message": "the body must be a JSON object"}})
        with self._lock:
            answer = self.script.pop(0) if self.script else self.default
        if not isinstance(answer, Answer):
            answer = answer(api, req)
        n = int(req.get("n") or 1) if api in ("chat", "completions") else 1
        build = Reply(self, api, req, answer, n, next(self._counter))
        first = answer.tool_calls[0] if answer.tool_calls else None
        with self._lock:
            self.answers.append(
                {
                    "kind": "tool" if first else "text",
                    "name": first[0] if first else None,
                    "args": first[1] if first else None,
                    "text": answer.text,
                    "prompt_token_ids": build.prompt_ids,
                    "token_ids": build.ids,
                }
            )
        if req.get("stream"):
            return await self._send_stream(writer, build.events())
        return await self._send_json(writer, 200, build.whole())

    async def _send_json(self, writer: asyncio.StreamWriter, status: int, obj: Any) -> bool:
        data = json.dumps(obj).encode()
        writer.write(
            b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (status, len(data))
            + data
        )
        await writer.drain()
        return True

    async def _send_stream(self, writer: asyncio.StreamWriter, events: list[bytes]) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        try:
            for n, ev in enumerate(events):
                if self.cut_after_events is not None and n >= self.cut_after_events:
                    writer.transport.abort()  # the server dies mid-stream
                    return False
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
                if writer.transport.is_closing():
                    raise ConnectionResetError
                writer.write(b"%x\r\n%b\r\n" % (len(ev), ev))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except ConnectionError:
            self.cancelled += 1
            return False
        return True
