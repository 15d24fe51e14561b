"""A scripted, vLLM-shaped model server for tests: the upstream behind the proxy (CONTRACTS A).

Serves ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/messages`` (stream and
not) and ``GET /v1/models`` / ``GET /health`` on loopback, from a raw-asyncio server in a background thread.
Token ids are bytes: the prompt is rendered ChatML-style and its UTF-8 bytes are the ``prompt_token_ids``; a
completion's ids are the bytes of its text (tool calls rendered as ``<tool_call>{json}</tool_call>``), so a
follow-up turn's prompt ids extend the previous ones the way a real template would. Ids are returned only
when the request asks (``return_token_ids``), logprobs only when ``logprobs`` is set, as vLLM does.

Usage::

    from tests.support.upstream import ScriptedUpstream, say, tool_call

    with ScriptedUpstream([tool_call("get_weather", {"city": "Paris"}), say("It is sunny.")]) as up:
        up.url                    # "http://127.0.0.1:PORT" (no /v1)
        ...                       # each request takes the next scripted answer; then `default` is used
        up.requests               # [SeenRequest(method, path, query, headers, body)], .json() parses
        up.ids = False            # knobs, settable any time: ids, delay_s, chunk_delay_s,
        up.error_status = 500     #   error_status (answer every call with this error), hang (never answer),
                                  #   cut_after_events (drop the connection mid-stream after N SSE events)
    # stop() on exit; or up = ScriptedUpstream().start(); ...; up.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Answer:
    """One scripted completion: text and/or tool calls (name, arguments)."""

    text: str = ""
    tool_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    finish_reason: str | None = None  # default: "tool_calls" when there are tool calls, else "stop"


def say(text: str) -> Answer:
    return Answer(text=text)


def tool_call(name: str, arguments: dict[str, Any], text: str = "") -> Answer:
    return Answer(text=text, tool_calls=[(name, arguments)])


@dataclass
class SeenRequest:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


def render_prompt(api: str, req: dict[str, Any]) -> str:
    """The ChatML-style prompt text whose bytes are the prompt ids."""
    if api == "completions":
        p = req.get("prompt", "")
        return p if isinstance(p, str) else "".join(map(str, p))
    msgs: list[tuple[str, Any]] = []
    if api == "messages" and req.get("system"):
        msgs.append(("system", req["system"]))
    if api == "responses":
        if req.get("instructions"):
            msgs.append(("system", req["instructions"]))
        inp = req.get("input", "")
        if isinstance(inp, str):
            msgs.append(("user", inp))
        else:
            for item in inp:
                msgs.append((item.get("role", item.get("type", "user")), item.get("content", item.get("output", item))))
    else:
        for m in req.get("messages", []):
            content = m.get("content")
            if m.get("tool_calls"):
                content = (content or "") + "".join(
                    "<tool_call>"
                    + json.dumps({"name": t["function"]["name"], "arguments": t["function"]["arguments"]})
                    + "</tool_call>"
                    for t in m["tool_calls"]
                )
            msgs.append((m.get("role", "user"), content))
    out = []
    for role, content in msgs:
        text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
        out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def _logprob(token_id: int) -> float:
    return -round(((token_id * 7919) % 97 + 1) / 50.0, 4)


def _lp_entries(ids: list[int]) -> list[dict[str, Any]]:
    return [
        {"token": chr(i) if i < 128 else f"<0x{i:02X}>", "logprob": _logprob(i), "bytes": [i], "top_logprobs": []}
        for i in ids
    ]


class ScriptedUpstream:
    """The scripted server (see module docstring). Thread-safe to reconfigure between calls."""

    def __init__(
        self,
        script: Iterable[Answer] = (),
        *,
        default: Answer | None = None,
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
        self.default = default or say("ok")
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
        if method == "GET" and path in ("/v1/models", "/models"):
            return await self._send_json(
                writer,
                200,
                {
                    "object": "list",
                    "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "clawpipe"}],
                },
            )
        if method == "GET" and path == "/health":
            return await self._send_json(
                writer, 200, {"status": "ok", "policy_version": self.policy_version, "model": self.model}
            )
        apis = {
            "/v1/chat/completions": "chat",
            "/v1/completions": "completions",
            "/v1/messages": "messages",
            "/v1/responses": "responses",
        }
        api = apis.get(path)
        if method != "POST" or api is None:
            return await self._send_json(writer, 404, {"error": {"message": f"no route {method} {path}"}})
        if self.error_status:
            msg = {"error": {"message": "scripted upstream error", "type": "server_error", "code": self.error_status}}
            return await self._send_json(writer, self.error_status, msg)
        try:
            req = json.loads(body)
        except ValueError:
            return await self._send_json(writer, 400, {"error": {"message": "invalid JSON"}})
        with self._lock:
            answer = self.script.pop(0) if self.script else self.default
        n = int(req.get("n") or 1) if api in ("chat", "completions") else 1
        build = _Build(self, api, req, answer, n, next(self._counter))
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


class _Build:
    """Bodies and SSE events of one answer, per API."""

    def __init__(self, up: ScriptedUpstream, api: str, req: dict[str, Any], answer: Answer, n: int, k: int) -> None:
        self.up, self.api, self.req, self.answer, self.n, self.k = up, api, req, answer, n, k
        self.want_ids = up.ids and bool(req.get("return_token_ids"))
        self.want_lp = bool(req.get("logprobs")) or api in ("messages", "responses")
        self.prompt_ids = list(render_prompt(api, req).encode())
        self.calls = [(f"call_{k}_{i}", name, json.dumps(args)) for i, (name, args) in enumerate(answer.tool_calls)]
        self.text_ids = list(answer.text.encode())
        self.call_ids = [
            list(("<tool_call>" + json.dumps({"name": name, "arguments": json.loads(args)}) + "</tool_call>").encode())
            for _, name, args in self.calls
        ]
        self.ids = self.text_ids + [i for c in self.call_ids for i in c]
        self.finish = answer.finish_reason or ("tool_calls" if self.calls else "stop")

    def _usage(self) -> dict[str, int]:
        p, c = len(self.prompt_ids), len(self.ids)
        if self.api in ("messages",):
            return {"input_tokens": p, "output_tokens": c}
        if self.api == "responses":
            return {
                "input_tokens": p,
                "output_tokens": c,
                "total_tokens": p + c,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            }
        return {"prompt_tokens": p, "completion_tokens": c * self.n, "total_tokens": p + c * self.n}

    def _pieces(self) -> list[str]:
        t, step = self.answer.text, max(1, self.up.chunk_chars)
        return [t[i : i + step] for i in range(0, len(t), step)]

    def _ids_extra(self, ids: list[int]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.want_ids:
            out["token_ids"] = ids
        if self.want_lp:
            out["logprobs"] = {"content": _lp_entries(ids)}
        return out

    def _top(self) -> dict[str, Any]:
        out: dict[str, Any] = {"policy_version": self.up.policy_version}
        if self.want_ids:
            out["prompt_token_ids"] = self.prompt_ids
        return out

    def _openai_whole(self, rid: str, obj: str, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """A non-streamed OpenAI body (chat.completion or text_completion) around ``choices``."""
        return {
            "id": rid,
            "object": obj,
            "created": 0,
            "model": model,
            "choices": choices,
            "usage": self._usage(),
            **self._top(),
        }

    # --- non-stream --------------------------------------------------------------------------------------
    def whole(self) -> dict[str, Any]:
        model = self.req.get("model") or self.up.model
        if self.api == "chat":
            msg: dict[str, Any] = {"role": "assistant", "content": self.answer.text or None}
            if self.calls:
                msg["tool_calls"] = [
                    {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                    for cid, name, args in self.calls
                ]
            choices = [
                {"index": i, "message": msg, "finish_reason": self.finish, **self._ids_extra(self.ids)}
                for i in range(self.n)
            ]
            return self._openai_whole(f"chatcmpl-{self.k}", "chat.completion", model, choices)
        if self.api == "completions":
            choices = [
                {"index": i, "text": self.answer.text, "finish_reason": self.finish, **self._ids_extra(self.text_ids)}
                for i in range(self.n)
            ]
            return self._openai_whole(f"cmpl-{self.k}", "text_completion", model, choices)
        if self.api == "messages":
            content: list[dict[str, Any]] = []
            if self.answer.text:
                content.append({"type": "text", "text": self.answer.text})
            for cid, name, args in self.calls:
                content.append({"type": "tool_use", "id": f"toolu_{cid}", "name": name, "input": json.loads(args)})
            return {
                "id": f"msg_{self.k}",
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": content,
                "stop_reason": "tool_use" if self.calls else "end_turn",
                "stop_sequence": None,
                "usage": self._usage(),
                **self._top(),
                **self._ids_extra(self.ids),
            }
        return self._response_obj("completed", self._response_items())

    def _response_items(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if self.answer.text:
            items.append(
                {
                    "type": "message",
                    "id": f"msg_{self.k}",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": self.answer.text, "annotations": []}],
                }
            )
        for cid, name, args in self.calls:
            items.append(
                {
                    "type": "function_call",
                    "id": f"fc_{cid}",
                    "call_id": cid,
                    "name": name,
                    "arguments": args,
                    "status": "completed",
                }
            )
        return items

    def _response_obj(self, status: str, output: list[dict[str, Any]], final: bool = True) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": f"resp_{self.k}",
            "object": "response",
            "created_at": 0,
            "status": status,
            "model": self.req.get("model") or self.up.model,
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "policy_version": self.up.policy_version,
        }
        if final:
            obj["usage"] = self._usage()
            obj.update(self._top())
            obj.update(self._ids_extra(self.ids))
        return obj

    # --- stream ------------------------------------------------------------------------------------------
    def events(self) -> list[bytes]:
        return getattr(self, f"_events_{self.api}")()

    @staticmethod
    def _data(obj: Any) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    @staticmethod
    def _event(name: str, obj: dict[str, Any]) -> bytes:
        return b"event: " + name.encode() + b"\ndata: " + json.dumps({"type": name, **obj}).encode() + b"\n\n"

    def _events_chat(self) -> list[bytes]:
        base = {"id": f"chatcmpl-{self.k}", "object": "chat.completion.chunk", "created": 0, "model": self.up.model}
        out = []
        first = {**base, **self._top()}
        first["choices"] = [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None} for i in range(self.n)
        ]
        out.append(self._data(first))
        for piece in self._pieces():
            ids = list(piece.encode())
            out.append(
                self._data(
                    {
                        **base,
                        "choices": [
                            {"index": i, "delta": {"content": piece}, "finish_reason": None, **self._ids_extra(ids)}
                            for i in range(self.n)
                        ],
                    }
                )
            )
        for j, ((cid, name, args), ids) in enumerate(zip(self.calls, self.call_ids, strict=True)):
            delta = {
                "tool_calls": [
                    {"index": j, "id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                ]
            }
            out.append(
                self._data(
                    {
                        **base,
                        "choices": [
                            {"index": i, "delta": delta, "finish_reason": None, **self._ids_extra(ids)}
                            for i in range(self.n)
                        ],
                    }
                )
            )
        out.append(
            self._data(
                {**base, "choices": [{"index": i, "delta": {}, "finish_reason": self.finish} for i in range(self.n)]}
            )
        )
        if (self.req.get("stream_options") or {}).get("include_usage"):
            out.append(self._data({**base, "choices": [], "usage": self._usage()}))
        out.append(b"data: [DONE]\n\n")
        return out

    def _events_completions(self) -> list[bytes]:
        base = {"id": f"cmpl-{self.k}", "object": "text_completion", "created": 0, "model": self.up.model}
        out = []
        pieces = self._pieces() or [""]
        for j, piece in enumerate(pieces):
            chunk = {
                **base,
                "choices": [
                    {"index": i, "text": piece, "finish_reason": None, **self._ids_extra(list(piece.encode()))}
                    for i in range(self.n)
                ],
            }
            if j == 0:
                chunk.update(self._top())
            out.append(self._data(chunk))
        out.append(
            self._data(
                {**base, "choices": [{"index": i, "text": "", "finish_reason": self.finish} for i in range(self.n)]}
            )
        )
        out.append(b"data: [DONE]\n\n")
        return out

    def _events_messages(self) -> list[bytes]:
        ev = self._event
        msg = {
            "id": f"msg_{self.k}",
            "type": "message",
            "role": "assistant",
            "model": self.req.get("model") or self.up.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(self.prompt_ids), "output_tokens": 1},
            **self._top(),
        }
        out = [ev("message_start", {"message": msg})]
        idx = 0
        if self.answer.text:
            out.append(ev("content_block_start", {"index": idx, "content_block": {"type": "text", "text": ""}}))
            for piece in self._pieces():
                out.append(ev("content_block_delta", {"index": idx, "delta": {"type": "text_delta", "text": piece}}))
            out.append(ev("content_block_stop", {"index": idx}))
            idx += 1
        for cid, name, args in self.calls:
            block = {"type": "tool_use", "id": f"toolu_{cid}", "name": name, "input": {}}
            out.append(ev("content_block_start", {"index": idx, "content_block": block}))
            out.append(
                ev("content_block_delta", {"index": idx, "delta": {"type": "input_json_delta", "partial_json": args}})
            )
            out.append(ev("content_block_stop", {"index": idx}))
            idx += 1
        delta = {
            "delta": {"stop_reason": "tool_use" if self.calls else "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": len(self.ids)},
            **self._ids_extra(self.ids),
        }
        out.append(ev("message_delta", delta))
        out.append(ev("message_stop", {}))
        return out

    def _events_responses(self) -> list[bytes]:
        seq = itertools.count()

        def ev(name: str, obj: dict[str, Any]) -> bytes:
            return self._event(name, {"sequence_number": next(seq), **obj})

        out = [ev("response.created", {"response": self._response_obj("in_progress", [], final=False)})]
        items = self._response_items()
        for oi, item in enumerate(items):
            if item["type"] == "message":
                started = {**item, "status": "in_progress", "content": []}
                out.append(ev("response.output_item.added", {"output_index": oi, "item": started}))
                part = {"type": "output_text", "text": "", "annotations": []}
                common = {"item_id": item["id"], "output_index": oi, "content_index": 0}
                out.append(ev("response.content_part.added", {**common, "part": part}))
                for piece in self._pieces():
                    out.append(ev("response.output_text.delta", {**common, "delta": piece, "logprobs": []}))
                out.append(ev("response.output_text.done", {**common, "text": self.answer.text, "logprobs": []}))
                out.append(ev("response.content_part.done", {**common, "part": item["content"][0]}))
            else:
                started = {**item, "arguments": "", "status": "in_progress"}
                out.append(ev("response.output_item.added", {"output_index": oi, "item": started}))
                common = {"item_id": item["id"], "output_index": oi}
                out.append(ev("response.function_call_arguments.delta", {**common, "delta": item["arguments"]}))
                out.append(ev("response.function_call_arguments.done", {**common, "arguments": item["arguments"]}))
            out.append(ev("response.output_item.done", {"output_index": oi, "item": item}))
        out.append(ev("response.completed", {"response": self._response_obj("completed", items)}))
        return out
