"""A scripted, vLLM-shaped model server on loopback for the real-CLI-harness tests.

It answers the four APIs the harnesses speak (/v1/chat/completions, /v1/completions, /v1/responses,
/v1/messages; streamed or not; any path prefix such as /r/<key> before /v1) with a fixed two-step script:

- a request that offers a shell tool and carries no tool result yet gets a call of that tool with
  ``command`` (the CLI then runs it). The shell tool is found by its schema, not its name (see
  :func:`find_shell_tool`), so any CLI's shell tool is called;
- every other request (the follow-up with the tool's output, titles, side calls) gets the text ``reply``.

Each answer carries token ids in the shape of CONTRACTS A (``prompt_token_ids``, ``token_ids``,
``logprobs``, ``policy_version``). Ids are a byte-level "tokenizer" over a canonical rendering of the
conversation (system, then each message as ``<role>content</role>``; tool calls as name + sorted-key JSON;
the prompt ends with the generation prompt ``<assistant>`` and a completion with ``</assistant>``), so a
follow-up that appends to the history gets prompt ids that extend the earlier prompt + completion.
Every request is recorded (method, path, query, headers, JSON body) in ``ScriptedUpstream.requests``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

# Argument names that hold a shell command, and words that mark a tool as a shell in its name or description.
COMMAND_KEYS = ("command", "cmd", "script", "commands")
SHELL_WORDS = ("shell", "bash", "terminal", "exec", "command")


@dataclass(frozen=True)
class ShellTool:
    """A tool found to run shell commands: its name, the argument that takes the command, and whether that
    argument is an argv list (``["bash", "-lc", CMD]``) rather than a string."""

    name: str
    key: str
    argv: bool
    properties: tuple[str, ...]


def _tool_schema(tool: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(name, description, JSON schema of the arguments) of a tool of any of the three APIs."""
    fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool  # chat nests under "function"
    schema = fn.get("parameters") or fn.get("input_schema") or {}  # chat/responses vs messages
    return str(fn.get("name") or ""), str(fn.get("description") or ""), schema if isinstance(schema, dict) else {}


def _command_key(schema: dict[str, Any]) -> tuple[str, bool] | None:
    """The property that takes the command, and whether it is an argv list; None when there is none."""
    props = schema.get("properties") or {}
    required = schema.get("required") or []
    for key in COMMAND_KEYS:
        prop = props.get(key)
        if not isinstance(prop, dict) or key not in required:
            continue
        kind = prop.get("type")
        if kind == "string":
            return key, False
        if kind == "array" and (prop.get("items") or {}).get("type") == "string":
            return key, True
    return None


def find_shell_tool(tools: list[Any]) -> ShellTool | None:
    """The shell-like tool among ``tools`` (any API's tool list), found by schema alone.

    A candidate takes a REQUIRED command argument (``command``/``cmd``/``script``/``commands``) as a string or
    a list of strings. Among candidates the one whose name or description speaks of a shell
    (:data:`SHELL_WORDS`) wins, then the one with the fewest required arguments (a plain shell over a
    tool that needs more); ties keep the list's order. Tools that are not functions (hosted, namespaces)
    are ignored."""
    best: tuple[int, int, int] | None = None
    found: ShellTool | None = None
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "function", "custom"):
            continue
        name, description, schema = _tool_schema(tool)
        hit = _command_key(schema)
        if not name or hit is None:
            continue
        text = f"{name} {description}".lower()
        rank = (0 if any(w in text for w in SHELL_WORDS) else 1, len(schema.get("required") or []), i)
        if best is None or rank < best:
            best = rank
            found = ShellTool(name, hit[0], hit[1], tuple(schema.get("properties") or {}))
    return found


@dataclass
class RecordedRequest:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any
    raw_len: int
    t: float = field(default_factory=time.time)


def render_tokens(text: str) -> list[int]:
    """The fake tokenizer: one id per UTF-8 byte, offset so that 0..255 stay free for specials."""
    return [256 + b for b in text.encode()]


def _canon(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _text_of(content: Any) -> str:
    """Flatten a content field (str, or a list of blocks of any of the three APIs) into text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, dict):
                btype = block.get("type")
                if btype in ("text", "input_text", "output_text"):
                    parts.append(str(block.get("text", "")))
                elif btype == "tool_use":
                    parts.append(f"<tool_call>{block.get('name')}:{_canon(block.get('input'))}</tool_call>")
                elif btype == "tool_result":
                    parts.append(f"<tool_result>{_text_of(block.get('content'))}</tool_result>")
                elif btype in ("thinking", "redacted_thinking", "reasoning"):
                    continue
                else:
                    parts.append(_canon(block))
        return "".join(parts)
    return _canon(content)


def render_conversation(api: str, body: dict[str, Any]) -> str:
    """Canonical text of a request's conversation (the fake chat template)."""
    out: list[str] = []
    if api == "messages":
        system = body.get("system")
        if system:
            out.append(f"<system>{_text_of(system)}</system>")
        for msg in body.get("messages", []):
            out.append(f"<{msg.get('role')}>{_text_of(msg.get('content'))}</{msg.get('role')}>")
    elif api == "responses":
        if body.get("instructions"):
            out.append(f"<system>{body['instructions']}</system>")
        items = body.get("input", [])
        if isinstance(items, str):
            items = [{"type": "message", "role": "user", "content": items}]
        for item in items:
            itype = item.get("type", "message")
            if itype == "message":
                out.append(f"<{item.get('role')}>{_text_of(item.get('content'))}</{item.get('role')}>")
            elif itype == "function_call":
                args = _loads_or_raw(item.get("arguments"))
                out.append(f"<assistant><tool_call>{item.get('name')}:{_canon(args)}</tool_call></assistant>")
            elif itype == "function_call_output":
                out.append(f"<tool>{_text_of(item.get('output'))}</tool>")
    elif api == "chat":
        for msg in body.get("messages", []):
            text = _text_of(msg.get("content"))
            for tc in msg.get("tool_calls") or []:
                fn = tc.get("function", {})
                text += f"<tool_call>{fn.get('name')}:{_canon(_loads_or_raw(fn.get('arguments')))}</tool_call>"
            out.append(f"<{msg.get('role')}>{text}</{msg.get('role')}>")
    else:  # completions: the prompt is the text, no generation prompt
        return str(body.get("prompt", ""))
    out.append("<assistant>")  # the generation prompt; the completion ends with "</assistant>" (the eos)
    return "".join(out)


def _loads_or_raw(text: Any) -> Any:
    if isinstance(text, str):
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text


def _has_tool_result(api: str, body: dict[str, Any]) -> bool:
    if api == "chat":
        return any(m.get("role") == "tool" for m in body.get("messages", []))
    if api == "messages":
        for m in body.get("messages", []):
            if isinstance(m.get("content"), list) and any(
                isinstance(b, dict) and b.get("type") == "tool_result" for b in m["content"]
            ):
                return True
        return False
    if api == "responses":
        items = body.get("input", [])
        return isinstance(items, list) and any(i.get("type") == "function_call_output" for i in items)
    return False


def api_of(path: str) -> str | None:
    for suffix, api in (
        ("/chat/completions", "chat"),
        ("/completions", "completions"),
        ("/responses", "responses"),
        ("/messages", "messages"),
    ):
        if path.endswith(suffix):
            return api
    return None


class ScriptedUpstream:
    """Start with ``start()``; ``url`` is the base (``http://127.0.0.1:PORT``); stop with ``stop()``."""

    def __init__(
        self,
        *,
        command: str = "echo scripted > tool_ran.txt",
        reply: str = "All done.",
        model: str = "scripted",
        policy_version: int = 3,
        use_tools: bool = True,
    ) -> None:
        self.command = command
        self.reply = reply
        self.model = model
        self.policy_version = policy_version
        self.use_tools = use_tools  # False: answer every request with text
        self.requests: list[RecordedRequest] = []
        self.answers: list[dict[str, Any]] = []  # per model request, in arrival order: kind, token ids, ...
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.server_address[1])

    def model_requests(self) -> list[RecordedRequest]:
        with self._lock:
            return [r for r in self.requests if r.method == "POST" and api_of(r.path)]

    def start(self) -> ScriptedUpstream:
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return

            def do_GET(self) -> None:
                upstream._record(self, b"")
                path = urlsplit(self.path).path
                if path.endswith("/models"):
                    self._json(200, {"object": "list", "data": [{"id": upstream.model, "object": "model"}]})
                elif path.endswith("/health"):
                    self._json(
                        200, {"status": "ok", "policy_version": upstream.policy_version, "model": upstream.model}
                    )
                else:
                    self._json(404, {"error": {"message": f"no route {path}"}})

            def do_HEAD(self) -> None:
                upstream._record(self, b"")
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = upstream._record(self, raw)
                api = api_of(urlsplit(self.path).path)
                if api is None or not isinstance(body, dict):
                    self._json(404, {"error": {"message": f"no route {self.path}"}})
                    return
                answer = upstream._answer(api, body)
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Cache-Control", "no-cache")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    for event, data in upstream._stream_events(api, body, answer):
                        chunk = (f"event: {event}\n" if event else "") + f"data: {data}\n\n"
                        self.wfile.write(chunk.encode())
                        self.wfile.flush()
                    self.close_connection = True
                else:
                    self._json(200, upstream._full_response(api, body, answer))

            def _json(self, status: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> ScriptedUpstream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals ---------------------------------------------------------------------------------

    def _record(self, handler: BaseHTTPRequestHandler, raw: bytes) -> Any:
        parts = urlsplit(handler.path)
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        rec = RecordedRequest(
            handler.command,
            parts.path,
            dict(parse_qsl(parts.query)),
            {k.lower(): v for k, v in handler.headers.items()},
            body,
            len(raw),
        )
        with self._lock:
            self.requests.append(rec)
        return body

    def _answer(self, api: str, body: dict[str, Any]) -> dict[str, Any]:
        """Decide the scripted answer: a shell tool call or text, with its token ids."""
        shell = find_shell_tool(body.get("tools") or [])
        prompt_ids = render_tokens(render_conversation(api, body))
        if self.use_tools and shell is not None and not _has_tool_result(api, body):
            args: dict[str, Any] = {shell.key: ["bash", "-lc", self.command] if shell.argv else self.command}
            if "description" in shell.properties:  # Claude Code's Bash asks for one
                args["description"] = "Run the scripted command"
            answer = {"kind": "tool", "name": shell.name, "args": args, "call_id": "call_" + uuid.uuid4().hex[:12]}
            rendered = f"<tool_call>{shell.name}:{_canon(args)}</tool_call>"
        else:
            answer = {"kind": "text", "text": self.reply}
            rendered = self.reply
        ids = render_tokens(rendered if api == "completions" else rendered + "</assistant>")
        answer.update(
            prompt_token_ids=prompt_ids,
            token_ids=ids,
            logprobs={
                "content": [
                    {"token": chr(i - 256) if i < 384 else "?", "logprob": -0.5, "bytes": [i - 256], "top_logprobs": []}
                    for i in ids
                ]
            },
        )
        with self._lock:
            self.answers.append(answer)
        return answer

    def _usage(self, answer: dict[str, Any]) -> tuple[int, int]:
        return len(answer["prompt_token_ids"]), len(answer["token_ids"])

    def _full_response(self, api: str, body: dict[str, Any], a: dict[str, Any]) -> dict[str, Any]:
        n_in, n_out = self._usage(a)
        ids = {"prompt_token_ids": a["prompt_token_ids"], "policy_version": self.policy_version}
        if api == "chat":
            msg: dict[str, Any] = {"role": "assistant", "content": None}
            if a["kind"] == "tool":
                msg["tool_calls"] = [
                    {
                        "id": a["call_id"],
                        "type": "function",
                        "function": {"name": a["name"], "arguments": json.dumps(a["args"])},
                    }
                ]
            else:
                msg["content"] = a["text"]
            return {
                "id": "chatcmpl-" + uuid.uuid4().hex,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model,
                **ids,
                "choices": [
                    {
                        "index": 0,
                        "message": msg,
                        "token_ids": a["token_ids"],
                        "logprobs": a["logprobs"],
                        "finish_reason": "tool_calls" if a["kind"] == "tool" else "stop",
                    }
                ],
                "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out},
            }
        if api == "completions":
            text = a.get("text") or json.dumps(a.get("args"))
            return {
                "id": "cmpl-" + uuid.uuid4().hex,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model,
                **ids,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "token_ids": a["token_ids"],
                        "logprobs": a["logprobs"],
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out},
            }
        if api == "messages":
            if a["kind"] == "tool":
                content = [
                    {"type": "tool_use", "id": "toolu_" + a["call_id"][5:], "name": a["name"], "input": a["args"]}
                ]
            else:
                content = [{"type": "text", "text": a["text"]}]
            return {
                "id": "msg_" + uuid.uuid4().hex,
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": content,
                "stop_reason": "tool_use" if a["kind"] == "tool" else "end_turn",
                "stop_sequence": None,
                "usage": {"input_tokens": n_in, "output_tokens": n_out},
                **ids,
                "token_ids": a["token_ids"],
                "logprobs": a["logprobs"],
            }
        return self._response_object(a, "completed", [self._response_item(a)])

    def _response_item(self, a: dict[str, Any]) -> dict[str, Any]:
        if a["kind"] == "tool":
            return {
                "type": "function_call",
                "id": "fc_" + a["call_id"][5:],
                "call_id": a["call_id"],
                "name": a["name"],
                "arguments": json.dumps(a["args"]),
                "status": "completed",
            }
        return {
            "type": "message",
            "id": a.setdefault("msg_id", "msg_" + uuid.uuid4().hex),
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": a["text"], "annotations": []}],
        }

    def _response_object(self, a: dict[str, Any], status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        n_in, n_out = self._usage(a)
        rid = a.setdefault("resp_id", "resp_" + uuid.uuid4().hex)
        obj: dict[str, Any] = {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "status": status,
            "model": self.model,
            "output": output,
            "policy_version": self.policy_version,
        }
        if status == "completed":
            obj.update(
                usage={
                    "input_tokens": n_in,
                    "output_tokens": n_out,
                    "total_tokens": n_in + n_out,
                    "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens_details": {"reasoning_tokens": 0},
                },
                prompt_token_ids=a["prompt_token_ids"],
                token_ids=a["token_ids"],
                logprobs=a["logprobs"],
            )
        return obj

    def _stream_events(self, api: str, body: dict[str, Any], a: dict[str, Any]) -> list[tuple[str, str]]:
        d = json.dumps
        n_in, n_out = self._usage(a)
        if api in ("chat", "completions"):
            cid = "chatcmpl-" + uuid.uuid4().hex
            obj = "chat.completion.chunk" if api == "chat" else "text_completion"
            base = {"id": cid, "object": obj, "created": int(time.time()), "model": self.model}

            def chunk(choice: dict[str, Any], **extra: Any) -> tuple[str, str]:
                return "", d({**base, **extra, "choices": [{"index": 0, **choice}]})

            events = []
            if api == "chat":
                events.append(
                    chunk(
                        {"delta": {"role": "assistant", "content": ""}, "finish_reason": None},
                        prompt_token_ids=a["prompt_token_ids"],
                        policy_version=self.policy_version,
                    )
                )
                if a["kind"] == "tool":
                    delta = {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": a["call_id"],
                                "type": "function",
                                "function": {"name": a["name"], "arguments": d(a["args"])},
                            }
                        ]
                    }
                else:
                    delta = {"content": a["text"]}
                events.append(
                    chunk(
                        {"delta": delta, "token_ids": a["token_ids"], "logprobs": a["logprobs"], "finish_reason": None}
                    )
                )
                events.append(chunk({"delta": {}, "finish_reason": "tool_calls" if a["kind"] == "tool" else "stop"}))
            else:
                text = a.get("text") or d(a.get("args"))
                events.append(
                    chunk(
                        {"text": text, "token_ids": a["token_ids"], "logprobs": a["logprobs"], "finish_reason": "stop"},
                        prompt_token_ids=a["prompt_token_ids"],
                        policy_version=self.policy_version,
                    )
                )
            if (body.get("stream_options") or {}).get("include_usage"):
                events.append(
                    (
                        "",
                        d(
                            {
                                **base,
                                "choices": [],
                                "usage": {
                                    "prompt_tokens": n_in,
                                    "completion_tokens": n_out,
                                    "total_tokens": n_in + n_out,
                                },
                            }
                        ),
                    )
                )
            events.append(("", "[DONE]"))
            return events
        if api == "messages":
            mid = "msg_" + uuid.uuid4().hex
            start = {
                "id": mid,
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": n_in, "output_tokens": 1},
                "prompt_token_ids": a["prompt_token_ids"],
                "policy_version": self.policy_version,
            }
            events = [("message_start", d({"type": "message_start", "message": start}))]
            if a["kind"] == "tool":
                block = {"type": "tool_use", "id": "toolu_" + a["call_id"][5:], "name": a["name"], "input": {}}
                delta = {"type": "input_json_delta", "partial_json": d(a["args"])}
            else:
                block = {"type": "text", "text": ""}
                delta = {"type": "text_delta", "text": a["text"]}
            events += [
                ("content_block_start", d({"type": "content_block_start", "index": 0, "content_block": block})),
                ("content_block_delta", d({"type": "content_block_delta", "index": 0, "delta": delta})),
                ("content_block_stop", d({"type": "content_block_stop", "index": 0})),
                (
                    "message_delta",
                    d(
                        {
                            "type": "message_delta",
                            "delta": {
                                "stop_reason": "tool_use" if a["kind"] == "tool" else "end_turn",
                                "stop_sequence": None,
                            },
                            "usage": {"output_tokens": n_out},
                            "token_ids": a["token_ids"],
                            "logprobs": a["logprobs"],
                        }
                    ),
                ),
                ("message_stop", d({"type": "message_stop"})),
            ]
            return events
        # responses
        seq = iter(range(1000))
        item = self._response_item(a)
        events = [
            (
                "response.created",
                d(
                    {
                        "type": "response.created",
                        "sequence_number": next(seq),
                        "response": self._response_object(a, "in_progress", []),
                    }
                ),
            ),
            (
                "response.in_progress",
                d(
                    {
                        "type": "response.in_progress",
                        "sequence_number": next(seq),
                        "response": self._response_object(a, "in_progress", []),
                    }
                ),
            ),
        ]
        if a["kind"] == "tool":
            added = {**item, "arguments": "", "status": "in_progress"}
            events += [
                (
                    "response.output_item.added",
                    d(
                        {
                            "type": "response.output_item.added",
                            "sequence_number": next(seq),
                            "output_index": 0,
                            "item": added,
                        }
                    ),
                ),
                (
                    "response.function_call_arguments.delta",
                    d(
                        {
                            "type": "response.function_call_arguments.delta",
                            "sequence_number": next(seq),
                            "item_id": item["id"],
                            "output_index": 0,
                            "delta": item["arguments"],
                        }
                    ),
                ),
                (
                    "response.function_call_arguments.done",
                    d(
                        {
                            "type": "response.function_call_arguments.done",
                            "sequence_number": next(seq),
                            "item_id": item["id"],
                            "output_index": 0,
                            "arguments": item["arguments"],
                        }
                    ),
                ),
            ]
        else:
            added = {**item, "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
            events += [
                (
                    "response.output_item.added",
                    d(
                        {
                            "type": "response.output_item.added",
                            "sequence_number": next(seq),
                            "output_index": 0,
                            "item": added,
                        }
                    ),
                ),
                (
                    "response.content_part.added",
                    d(
                        {
                            "type": "response.content_part.added",
                            "sequence_number": next(seq),
                            "item_id": item["id"],
                            "output_index": 0,
                            "content_index": 0,
                            "part": part,
                        }
                    ),
                ),
                (
                    "response.output_text.delta",
                    d(
                        {
                            "type": "response.output_text.delta",
                            "sequence_number": next(seq),
                            "item_id": item["id"],
                            "output_index": 0,
                            "content_index": 0,
                            "delta": a["text"],
                        }
                    ),
                ),
                (
                    "response.output_text.done",
                    d(
                        {
                            "type": "response.output_text.done",
                            "sequence_number": next(seq),
                            "item_id": item["id"],
                            "output_index": 0,
                            "content_index": 0,
                            "text": a["text"],
                        }
                    ),
                ),
                (
                    "response.content_part.done",
                    d(
                        {
                            "type": "response.content_part.done",
                            "sequence_number": next(seq),
                            "item_id": item["id"],
                            "output_index": 0,
                            "content_index": 0,
                            "part": {**part, "text": a["text"]},
                        }
                    ),
                ),
            ]
        events += [
            (
                "response.output_item.done",
                d({"type": "response.output_item.done", "sequence_number": next(seq), "output_index": 0, "item": item}),
            ),
            (
                "response.completed",
                d(
                    {
                        "type": "response.completed",
                        "sequence_number": next(seq),
                        "response": self._response_object(a, "completed", [item]),
                    }
                ),
            ),
        ]
        return events
