"""The four API dialects of the test upstream: one scripted answer as each API's body and SSE events.

Token ids are bytes: the prompt is the request's conversation (as :func:`clawpipe.apis.request_messages`
reads it, so all three chat dialects render alike) in ChatML, and its UTF-8 bytes are the
``prompt_token_ids``; a completion's ids are the bytes of its text and tool calls rendered as
:func:`render_call` does, which is also how a later prompt renders that assistant turn. So a follow-up
turn's prompt ids extend the earlier prompt + completion the way a real template's would, on every API.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from clawpipe.apis import request_messages, sse_frame
from clawpipe.errors import RequestShapeError
from tests.support.scripts import Answer


def render_call(name: str, arguments: Any) -> str:
    """One tool call as completion text (arguments' keys sorted, so a CLI's re-serialisation renders alike)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, sort_keys=True) + "</tool_call>"


def render_prompt(api: str, req: dict[str, Any]) -> str:
    """The ChatML prompt text whose bytes are the prompt ids (completions: the prompt itself)."""
    if api == "completions":
        p = req.get("prompt", "")
        return p if isinstance(p, str) else "".join(map(str, p))
    try:
        messages, _ = request_messages(api, req)
    except RequestShapeError:  # a malformed body still gets an answer: its JSON is the "conversation"
        messages = [{"role": "user", "content": json.dumps(req, sort_keys=True)}]
    out = []
    for m in messages:
        calls = "".join(
            render_call(t["function"]["name"], json.loads(t["function"]["arguments"]))
            for t in m.get("tool_calls") or ()
        )
        out.append(f"<|im_start|>{m['role']}\n{m['content']}{calls}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def prompt_ids(api: str, req: dict[str, Any]) -> list[int]:
    return list(render_prompt(api, req).encode())


def _logprob(token_id: int) -> float:
    return -round(((token_id * 7919) % 97 + 1) / 50.0, 4)


def _lp_entries(ids: list[int]) -> list[dict[str, Any]]:
    return [
        {"token": chr(i) if i < 128 else f"<0x{i:02X}>", "logprob": _logprob(i), "bytes": [i], "top_logprobs": []}
        for i in ids
    ]


class Reply:
    """Bodies and SSE events of one answer, per API (``up`` gives model, policy_version, ids, chunk_chars)."""

    def __init__(self, up: Any, api: str, req: dict[str, Any], answer: Answer, n: int, k: int) -> None:
        self.up, self.api, self.req, self.answer, self.n, self.k = up, api, req, answer, n, k
        self.want_ids = up.ids and bool(req.get("return_token_ids"))
        self.want_lp = bool(req.get("logprobs")) or api in ("messages", "responses")
        self.prompt_ids = list(render_prompt(api, req).encode())
        self.calls = [(f"call_{k}_{i}", name, json.dumps(args)) for i, (name, args) in enumerate(answer.tool_calls)]
        self.text_ids = list(answer.text.encode())
        self.call_ids = [list(render_call(name, json.loads(args)).encode()) for _, name, args in self.calls]
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
        return sse_frame(obj)

    @staticmethod
    def _event(name: str, obj: dict[str, Any]) -> bytes:
        return sse_frame({"type": name, **obj}, name)

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
