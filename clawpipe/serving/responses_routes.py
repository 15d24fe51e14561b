"""OpenAI Responses routes (stream and not), as Codex CLI uses them; the standard SSE event sequence."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response

from clawpipe.errors import ServingError
from clawpipe.serving import convert
from clawpipe.serving.params import RequestError, SamplingParams
from clawpipe.serving.routes import Choice, Routes, sse
from clawpipe.serving.splice import Prompt
from clawpipe.serving.text import new_id

Kept = tuple[list[dict[str, Any]], list[dict[str, Any]]]  # the whole input a response ran on; its request's part


def _query_int(query: dict[str, str], key: str, default: int, lo: int, hi: int) -> int:
    raw = query.get(key)
    if raw is None:
        return default
    # plain digits, a few of them: no sign, space or "1_0", and no 5,000-digit number for int() to refuse
    value = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 6 else lo - 1
    if not lo <= value <= hi:
        raise RequestError(f"'{key}' must be an integer from {lo} to {hi}, got {raw!r}", param=key)
    return value


def _listed_item(item: dict[str, Any], suffix: str) -> dict[str, Any]:
    """An input item as the input_items list shows it: typed, with an id, a message's text as a content part."""
    kind = item.get("type") or ("message" if "role" in item else "item")
    out = {**item, "type": kind, "id": item.get("id") or f"{'msg' if kind == 'message' else 'item'}_{suffix}"}
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": item["content"]}]
    return out


class ResponsesRoutes(Routes):
    """OpenAI Responses routes (stream and not), as Codex CLI uses them; the standard SSE event sequence."""

    # ------------------------------------------------------------ /v1/responses (OpenAI Responses)

    async def responses(self, body: dict[str, Any]) -> Response:
        model = self.model_name(body)
        store = body.get("store", True)
        if not isinstance(store, bool | None):
            raise RequestError("'store' must be true or false")
        own = items = convert.input_items(body)
        if body.get("previous_response_id") is not None:
            items = [*self.responses_store.context(body["previous_response_id"]), *items]
        messages, tools = convert.responses_messages({**body, "input": items})
        tools = convert.apply_tool_choice(body, tools, "responses")
        prompt = await self.render(messages, tools)
        params = self.build_params(
            body, prompt, convert.int_field(body, "max_output_tokens"), [], forced=convert.forced_call(body, tools)
        )
        skeleton = {
            "id": f"resp_{new_id('', 12)}",
            "object": "response",
            "created_at": int(time.time()),
            "model": model,
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions") if isinstance(body.get("instructions"), str) else None,
            "metadata": body.get("metadata") or {},
            "output": [],
            "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
            "temperature": params.temperature,
            "top_p": params.top_p,
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [],
            "max_output_tokens": body.get("max_output_tokens"),
            "text": {"format": {"type": "text"}},
            "reasoning": {"effort": None, "summary": None},
            "previous_response_id": body.get("previous_response_id"),
            "store": store is not False,
            "usage": None,
        }
        keep = (items, own) if store is not False else None
        if body.get("stream"):
            return self.sse_response(self._responses_stream(prompt, params, bool(tools), skeleton, keep))
        version, (c,) = await self.run(prompt, params, bool(tools))
        content, calls = c.full()
        self.keep_turn(prompt, c, calls)
        done = self._response_done(skeleton, prompt, c, self._response_items(content, calls), version)
        self._keep(done, keep)
        return JSONResponse(done)

    def _keep(self, done: dict[str, Any], keep: Kept | None) -> None:
        """Keep a finished response for later previous_response_id references and reading back (unless store
        was false); ``keep``: the whole input it ran on, and the part its request sent."""
        if keep is not None:
            self.responses_store.put(done["id"], keep[0], done["output"], done, keep[1])

    # ------------------------------------------------------------ stored responses read back, deleted

    def _not_kept(self, response_id: str) -> RequestError:
        return RequestError(
            f"Response with id '{response_id}' not found: this server keeps the last "
            f"{self.responses_store.max_responses} responses created with store true (the default), in memory",
            status=404,
            code="response_not_found",
        )

    def stored_response(self, response_id: str, query: dict[str, str] | None = None) -> dict[str, Any]:
        """``GET /v1/responses/{id}``: the response as it was answered (without the per-token fields). Its
        events are not kept, so ``stream=true`` (which would replay them) is a 400, not a JSON body a streaming
        client reads as no events at all."""
        if (query or {}).get("stream", "false").lower() not in ("false", "0", ""):
            raise RequestError(
                "'stream' is not supported when reading a stored response: its events are not kept; "
                "read it without stream",
                param="stream",
            )
        found = self.responses_store.response(response_id)
        if found is None:
            raise self._not_kept(response_id)
        return found

    def deleted_response(self, response_id: str) -> dict[str, Any]:
        """``DELETE /v1/responses/{id}``; responses that continue it keep their context."""
        if not self.responses_store.delete(response_id):
            raise self._not_kept(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def stored_input_items(self, response_id: str, query: dict[str, str]) -> dict[str, Any]:
        """``GET /v1/responses/{id}/input_items``: the items its request sent, as a list page (``limit`` 1-100,
        default 20; ``order`` asc or desc, the default; ``after`` an item id)."""
        own = self.responses_store.own_input(response_id)
        if own is None:
            raise self._not_kept(response_id)
        limit = _query_int(query, "limit", 20, 1, 100)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise RequestError(f"'order' must be asc or desc, got {order!r}", param="order")
        items = [_listed_item(item, f"{response_id[5:]}_{i}") for i, item in enumerate(own)]
        if order == "desc":
            items.reverse()
        after = query.get("after")
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise RequestError(f"'after' names no input item of {response_id}: {after!r}", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }

    @staticmethod
    def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
        return {
            "type": "message",
            "id": item_id,
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
            if status == "completed"
            else [],
        }

    @staticmethod
    def _call_item(tc: Any, status: str = "completed") -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": f"fc_{tc.id[5:]}",
            "call_id": tc.id,
            "name": tc.name,
            "arguments": tc.arguments if status == "completed" else "",
            "status": status,
        }

    def _response_items(self, content: str, calls: list[Any], msg_id: str | None = None) -> list[dict[str, Any]]:
        items = []
        if content or not calls:
            items.append(self._message_item(msg_id or f"msg_{new_id('', 12)}", content))
        items += [self._call_item(tc) for tc in calls]
        return items

    def _response_done(
        self, skeleton: dict[str, Any], prompt: Prompt, c: Choice, items: list[dict[str, Any]], version: int
    ) -> dict[str, Any]:
        n_out = len(c.token_ids)
        incomplete = c.finish_reason == "length" and not any(i["type"] == "function_call" for i in items)
        return {
            **skeleton,
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": items,
            "usage": {
                "input_tokens": len(prompt),
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": n_out,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": len(prompt) + n_out,
            },
            "prompt_token_ids": prompt,
            "spliced_tokens": prompt.spliced,
            "token_ids": c.token_ids,
            "logprobs": {"content": self.lp_entries(c)},
            "policy_version": version,
        }

    async def _responses_stream(
        self,
        prompt: Prompt,
        params: SamplingParams,
        tools: bool,
        skeleton: dict[str, Any],
        keep: Kept | None,
    ) -> AsyncIterator[bytes]:
        """The event sequence; cut short by the engine (shutdown, an engine error), it ends with an `error` event
        in the Responses API's shape, so the client (and a capture) sees why."""
        event = _Events()
        try:
            async for chunk in self._responses_events(event, prompt, params, tools, skeleton, keep):
                yield chunk
        except ServingError as exc:
            yield event("error", code="server_error", message=str(exc), param=None)

    async def _responses_events(
        self,
        event: _Events,
        prompt: Prompt,
        params: SamplingParams,
        tools: bool,
        skeleton: dict[str, Any],
        keep: Kept | None,
    ) -> AsyncIterator[bytes]:
        c = Choice(0, tools)
        version = self.engine.policy_version
        msg_id = f"msg_{new_id('', 12)}"
        opened = False
        text = ""
        async with contextlib.aclosing(self.engine.stream(prompt, params)) as stream:
            async for item in stream:
                if isinstance(item, tuple):
                    version = item[1]
                    yield event("response.created", response={**skeleton, "policy_version": version})
                    yield event("response.in_progress", response={**skeleton, "policy_version": version})
                    continue
                for ev in item:
                    piece = c.add(ev)
                    if not piece:
                        continue
                    if not opened:
                        opened = True
                        yield event(
                            "response.output_item.added",
                            output_index=0,
                            item=self._message_item(msg_id, "", "in_progress"),
                        )
                        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                        yield event(
                            "response.content_part.added", item_id=msg_id, output_index=0, content_index=0, part=part
                        )
                    text += piece
                    yield event(
                        "response.output_text.delta",
                        item_id=msg_id,
                        output_index=0,
                        content_index=0,
                        delta=piece,
                        logprobs=[],
                    )
        content, calls = c.finish()
        self.keep_turn(prompt, c, calls)
        if content or (not calls and not opened):
            if not opened:
                opened = True
                yield event(
                    "response.output_item.added", output_index=0, item=self._message_item(msg_id, "", "in_progress")
                )
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                yield event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0, part=part)
            if content:
                text += content
                yield event(
                    "response.output_text.delta",
                    item_id=msg_id,
                    output_index=0,
                    content_index=0,
                    delta=content,
                    logprobs=[],
                )
        items: list[dict[str, Any]] = []
        if opened:
            done_item = self._message_item(msg_id, text)
            yield event(
                "response.output_text.done", item_id=msg_id, output_index=0, content_index=0, text=text, logprobs=[]
            )
            yield event(
                "response.content_part.done",
                item_id=msg_id,
                output_index=0,
                content_index=0,
                part=done_item["content"][0],
            )
            yield event("response.output_item.done", output_index=0, item=done_item)
            items.append(done_item)
        for tc in calls:
            idx = len(items)
            added = self._call_item(tc, "in_progress")
            yield event("response.output_item.added", output_index=idx, item=added)
            yield event(
                "response.function_call_arguments.delta", item_id=added["id"], output_index=idx, delta=tc.arguments
            )
            yield event(
                "response.function_call_arguments.done",
                item_id=added["id"],
                output_index=idx,
                name=tc.name,
                arguments=tc.arguments,
            )
            done = self._call_item(tc)
            yield event("response.output_item.done", output_index=idx, item=done)
            items.append(done)
        done = self._response_done(skeleton, prompt, c, items, version)
        self._keep(done, keep)
        final = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        yield event(final, response=done)


class _Events:
    """SSE events of one Responses stream, numbered in order (sequence_number)."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq - 1, **fields}, kind)
