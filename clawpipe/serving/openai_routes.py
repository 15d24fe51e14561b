"""OpenAI Chat Completions routes (stream and not), with token ids and logprobs on every response."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response

from clawpipe.serving import convert
from clawpipe.serving.params import RequestError, SamplingParams
from clawpipe.serving.routes import Choice, Routes, sse
from clawpipe.serving.splice import Prompt
from clawpipe.serving.text import new_id


class ChatRoutes(Routes):
    """OpenAI Chat Completions routes (stream and not), with token ids and logprobs on every response."""

    # ------------------------------------------------------------ /v1/chat/completions

    async def chat(self, body: dict[str, Any]) -> Response:
        model = self.model_name(body)
        messages, tools = convert.chat_messages(body)
        tools = convert.apply_tool_choice(body, tools, "chat")
        prompt = await self.render(messages, tools, convert.chat_ending(body, messages))
        n = convert.int_field(body, "n")
        params = self.build_params(
            body,
            prompt,
            convert.int_field(body, "max_completion_tokens", "max_tokens"),
            convert.stop_list(body.get("stop")),
            n,
            convert.int_field(body, "top_logprobs") or 0,
            convert.forced_call(body, tools),
        )
        want_ids = True  # always: the proxy asks for ids, and SDK clients ignore extra fields
        if not isinstance(body.get("logprobs"), bool | None):
            raise RequestError("'logprobs' must be true or false")
        if params.top_logprobs and not body.get("logprobs"):
            # they would be computed and then not shown: the alternatives go out in logprobs.content
            raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        want_lp = bool(body.get("logprobs")) or bool(body.get("return_token_ids"))
        rid, created = f"chatcmpl-{new_id('', 12)}", int(time.time())
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            return self.sse_response(
                self._chat_stream(prompt, params, bool(tools), rid, created, model, want_ids, want_lp, opts)
            )
        version, choices = await self.run(prompt, params, bool(tools))
        out_choices = []
        for c in choices:
            content, calls = c.full()
            message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
            if calls:
                message["tool_calls"] = [
                    {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}
                    for tc in calls
                ]
            entry: dict[str, Any] = {
                "index": c.index,
                "message": message,
                "logprobs": {"content": self.lp_entries(c)} if want_lp else None,
                "finish_reason": "tool_calls" if calls else c.finish_reason,
                "stop_reason": c.stopped_on,
            }
            if want_ids:
                entry["token_ids"] = c.token_ids
            out_choices.append(entry)
            self.keep_turn(prompt, c, calls)
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": out_choices,
                "usage": self.usage(len(prompt), choices),
                "prompt_token_ids": prompt if want_ids else None,
                "spliced_tokens": prompt.spliced,
                "policy_version": version,
            }
        )

    async def _chat_stream(
        self,
        prompt: Prompt,
        params: SamplingParams,
        tools: bool,
        rid: str,
        created: int,
        model: str,
        want_ids: bool,
        want_lp: bool,
        opts: dict[str, Any],
    ) -> AsyncIterator[bytes]:
        base: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        choices = [Choice(i, tools) for i in range(params.n)]
        async with contextlib.aclosing(self.engine.stream(prompt, params)) as stream:
            async for item in stream:
                if isinstance(item, tuple):
                    base["policy_version"] = item[1]  # in every chunk from here on
                    first = {
                        **base,
                        "choices": [
                            {
                                "index": i,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                            for i in range(params.n)
                        ],
                        "prompt_token_ids": prompt if want_ids else None,
                        "spliced_tokens": prompt.spliced,
                    }
                    yield sse(first)
                    continue
                deltas, tails = [], []
                for ev in item:
                    c = choices[ev.index]
                    start = len(c.token_ids)
                    piece = c.add(ev)
                    d: dict[str, Any] = {
                        "index": c.index,
                        "delta": {"content": piece} if piece else {},
                        "logprobs": {"content": self.lp_entries(c, start)} if want_lp else None,
                        "finish_reason": None,
                    }
                    if want_ids:
                        d["token_ids"] = c.token_ids[start:]
                    deltas.append(d)
                    if c.finish_reason is not None:
                        tails.append(c)
                chunk = {**base, "choices": deltas}
                if opts.get("include_usage") and opts.get("continuous_usage_stats"):
                    chunk["usage"] = self.usage(len(prompt), choices)  # vLLM's running count, in every chunk
                yield sse(chunk)
                for c in tails:
                    content, calls = c.finish()
                    self.keep_turn(prompt, c, calls)
                    if content:
                        yield sse(
                            {
                                **base,
                                "choices": [{"index": c.index, "delta": {"content": content}, "finish_reason": None}],
                            }
                        )
                    if calls:
                        tc = [
                            {
                                "index": k,
                                "id": t.id,
                                "type": "function",
                                "function": {"name": t.name, "arguments": t.arguments},
                            }
                            for k, t in enumerate(calls)
                        ]
                        yield sse(
                            {
                                **base,
                                "choices": [{"index": c.index, "delta": {"tool_calls": tc}, "finish_reason": None}],
                            }
                        )
                    reason = "tool_calls" if calls else c.finish_reason
                    yield sse(
                        {
                            **base,
                            "choices": [
                                {"index": c.index, "delta": {}, "finish_reason": reason, "stop_reason": c.stopped_on}
                            ],
                        }
                    )
        if opts.get("include_usage"):
            yield sse({**base, "choices": [], "usage": self.usage(len(prompt), choices)})
        yield b"data: [DONE]\n\n"
