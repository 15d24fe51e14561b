"""OpenAI Chat Completions and Completions routes (stream and not), with token ids and logprobs per CONTRACTS A."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response

from clawpipe.serving import convert
from clawpipe.serving.params import RequestError, SamplingParams
from clawpipe.serving.routes import Choice, Routes, sse
from clawpipe.serving.text import new_id


class ChatRoutes(Routes):
    """OpenAI Chat Completions and Completions routes (stream and not), with token ids and logprobs per CONTRACTS A."""

    # ------------------------------------------------------------ /v1/chat/completions

    async def chat(self, body: dict[str, Any]) -> Response:
        messages, tools = convert.chat_messages(body)
        tools = convert.apply_tool_choice(body, tools, "chat")
        prompt = self.render(messages, tools)
        n = convert.int_field(body, "n")
        params = self.build_params(
            body,
            prompt,
            convert.int_field(body, "max_completion_tokens", "max_tokens"),
            convert.stop_list(body.get("stop")),
            n,
            convert.int_field(body, "top_logprobs") or 0,
        )
        want_ids = True  # always: the proxy asks for ids, and SDK clients ignore extra fields
        if not isinstance(body.get("logprobs"), bool | None):
            raise RequestError("'logprobs' must be true or false")
        want_lp = bool(body.get("logprobs")) or bool(body.get("return_token_ids"))
        rid, created, model = (
            f"chatcmpl-{new_id('', 12)}",
            int(time.time()),
            body.get("model") or self.engine.served_name,
        )
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
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": out_choices,
                "usage": self.usage(len(prompt), choices),
                "prompt_token_ids": prompt if want_ids else None,
                "policy_version": version,
            }
        )

    async def _chat_stream(
        self,
        prompt: list[int],
        params: SamplingParams,
        tools: bool,
        rid: str,
        created: int,
        model: str,
        want_ids: bool,
        want_lp: bool,
        opts: dict[str, Any],
    ) -> AsyncIterator[bytes]:
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        choices = [Choice(i, tools) for i in range(params.n)]
        async with contextlib.aclosing(self.engine.stream(prompt, params)) as stream:
            async for item in stream:
                if isinstance(item, tuple):
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
                        "policy_version": item[1],
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
                yield sse({**base, "choices": deltas})
                for c in tails:
                    content, calls = c.finish()
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

    # ------------------------------------------------------------ /v1/completions

    async def completions(self, body: dict[str, Any]) -> Response:
        prompt = self._completion_prompt(body.get("prompt"))
        n = convert.int_field(body, "n")
        logprobs = body.get("logprobs")  # legacy: the number of top alternatives (0-5); false/null: none
        if logprobs is not None and not isinstance(logprobs, bool | int):
            raise RequestError("'logprobs' must be an integer (0-5) or null")
        top = 0 if isinstance(logprobs, bool) or logprobs is None else logprobs
        if not 0 <= top <= 5:
            raise RequestError(f"'logprobs' must be in [0, 5], got {top}")
        params = self.build_params(
            body, prompt, convert.int_field(body, "max_tokens"), convert.stop_list(body.get("stop")), n, top
        )
        want_lp = (logprobs is not None and logprobs is not False) or bool(body.get("return_token_ids"))
        rid, created, model = f"cmpl-{new_id('', 12)}", int(time.time()), body.get("model") or self.engine.served_name
        base = {"id": rid, "object": "text_completion", "created": created, "model": model}
        if body.get("stream"):
            return self.sse_response(self._completions_stream(prompt, params, base, want_lp, body))
        version, choices = await self.run(prompt, params, False)
        return JSONResponse(
            {
                **base,
                "choices": [
                    {
                        "index": c.index,
                        "text": c.text,
                        "logprobs": self._completion_lp(c, 0) if want_lp else None,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stopped_on,
                        "token_ids": c.token_ids,
                    }
                    for c in choices
                ],
                "usage": self.usage(len(prompt), choices),
                "prompt_token_ids": prompt,
                "policy_version": version,
            }
        )

    def _completion_lp(self, c: Choice, start: int) -> dict[str, Any]:
        entries = self.lp_entries(c, start)
        return {
            "content": entries,
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries]
            if any(e["top_logprobs"] for e in entries)
            else None,
            "text_offset": [],
        }

    def _completion_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("'prompt' is empty")
            return list(self.engine.tokenizer.encode(prompt, add_special_tokens=False))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise RequestError("'prompt' must be one string or one list of token ids (batched prompts are not supported)")

    async def _completions_stream(
        self, prompt: list[int], params: SamplingParams, base: dict[str, Any], want_lp: bool, body: dict[str, Any]
    ) -> AsyncIterator[bytes]:
        choices = [Choice(i, False) for i in range(params.n)]
        async with contextlib.aclosing(self.engine.stream(prompt, params)) as stream:
            async for item in stream:
                if isinstance(item, tuple):
                    yield sse({**base, "choices": [], "prompt_token_ids": prompt, "policy_version": item[1]})
                    continue
                out = []
                for ev in item:
                    c = choices[ev.index]
                    start = len(c.token_ids)
                    piece = c.add(ev)
                    out.append(
                        {
                            "index": c.index,
                            "text": piece,
                            "logprobs": self._completion_lp(c, start) if want_lp else None,
                            "finish_reason": c.finish_reason,
                            "stop_reason": c.stopped_on,
                            "token_ids": c.token_ids[start:],
                        }
                    )
                yield sse({**base, "choices": out})
        if (body.get("stream_options") or {}).get("include_usage"):
            yield sse({**base, "choices": [], "usage": self.usage(len(prompt), choices)})
        yield b"data: [DONE]\n\n"
