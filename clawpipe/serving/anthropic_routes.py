"""Anthropic Messages routes (stream and not), as Claude Code uses them; token ids and logprobs on every response."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response

from clawpipe.serving import convert
from clawpipe.serving.params import RequestError, SamplingParams
from clawpipe.serving.routes import Choice, Routes, sse
from clawpipe.serving.splice import Prompt
from clawpipe.serving.text import new_id


class MessagesRoutes(Routes):
    """Anthropic Messages routes (stream and not), with token ids and logprobs on every response."""

    # ------------------------------------------------------------ /v1/messages (Anthropic)

    async def messages(self, body: dict[str, Any]) -> Response:
        model = self.model_name(body)
        if body.get("max_tokens") is None:
            # required by the Messages API (and its SDKs): a client relying on a default here would break there
            raise RequestError("max_tokens: Field required; send the most tokens to generate, e.g. 1024")
        messages, tools = convert.anthropic_messages(body)
        tools = convert.apply_tool_choice(body, tools, "anthropic")
        # a final assistant message is a prefill: the response continues it and holds only the continuation
        prompt = await self.render(messages, tools, convert.anthropic_ending(body, messages))
        params = self.build_params(
            body,
            prompt,
            convert.int_field(body, "max_tokens"),
            convert.stop_list(body.get("stop_sequences"), "stop_sequences"),
            forced=convert.forced_call(body, tools),
        )
        mid = f"msg_{new_id('', 12)}"
        if body.get("stream"):
            return self.sse_response(self._messages_stream(prompt, params, bool(tools), mid, model), anthropic=True)
        version, (c,) = await self.run(prompt, params, bool(tools))
        content, calls = c.full()
        self.keep_turn(prompt, c, calls)
        blocks: list[dict[str, Any]] = []
        if content or not calls:
            blocks.append({"type": "text", "text": content})
        blocks += [
            {"type": "tool_use", "id": f"toolu_{tc.id[5:]}", "name": tc.name, "input": json.loads(tc.arguments)}
            for tc in calls
        ]
        return JSONResponse(
            {
                "id": mid,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": blocks,
                "stop_reason": self._stop_reason(c, calls),
                "stop_sequence": self._stop_sequence(c),
                "usage": self._anthropic_usage(len(prompt), len(c.token_ids)),
                "prompt_token_ids": prompt,
                "spliced_tokens": prompt.spliced,
                "token_ids": c.token_ids,
                "logprobs": {"content": self.lp_entries(c)},
                "policy_version": version,
            }
        )

    @staticmethod
    def _stop_reason(c: Choice, calls: list[Any]) -> str:
        if calls:
            return "tool_use"
        if c.finish_reason == "length":
            return "max_tokens"
        return "stop_sequence" if MessagesRoutes._stop_sequence(c) else "end_turn"

    @staticmethod
    def _stop_sequence(c: Choice) -> str | None:
        """The stop sequence that ended the answer (a stop_token_ids id is an end of turn here)."""
        return c.stopped_on if isinstance(c.stopped_on, str) else None

    @staticmethod
    def _anthropic_usage(n_in: int, n_out: int) -> dict[str, Any]:
        return {
            "input_tokens": n_in,
            "output_tokens": n_out,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }

    async def _messages_stream(
        self, prompt: Prompt, params: SamplingParams, tools: bool, mid: str, model: str
    ) -> AsyncIterator[bytes]:
        c = Choice(0, tools)
        block = -1  # index of the open text block, -1 when none
        n_blocks = 0
        version = self.engine.policy_version
        async with contextlib.aclosing(self.engine.stream(prompt, params)) as stream:
            async for item in stream:
                if isinstance(item, tuple):
                    version = item[1]
                    message = {
                        "id": mid,
                        "type": "message",
                        "role": "assistant",
                        "model": model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": self._anthropic_usage(len(prompt), 0),
                        "prompt_token_ids": prompt,
                        "spliced_tokens": prompt.spliced,
                        "policy_version": item[1],
                    }
                    yield sse({"type": "message_start", "message": message}, "message_start")
                    yield sse({"type": "ping"}, "ping")
                    continue
                for ev in item:
                    piece = c.add(ev)
                    if piece:
                        if block < 0:
                            block, n_blocks = n_blocks, n_blocks + 1
                            yield sse(
                                {
                                    "type": "content_block_start",
                                    "index": block,
                                    "content_block": {"type": "text", "text": ""},
                                },
                                "content_block_start",
                            )
                        yield sse(
                            {
                                "type": "content_block_delta",
                                "index": block,
                                "delta": {"type": "text_delta", "text": piece},
                            },
                            "content_block_delta",
                        )
        content, calls = c.finish()
        self.keep_turn(prompt, c, calls)
        if content or (not calls and block < 0):
            if block < 0:
                block, n_blocks = n_blocks, n_blocks + 1
                yield sse(
                    {"type": "content_block_start", "index": block, "content_block": {"type": "text", "text": ""}},
                    "content_block_start",
                )
            if content:
                yield sse(
                    {"type": "content_block_delta", "index": block, "delta": {"type": "text_delta", "text": content}},
                    "content_block_delta",
                )
        if block >= 0:
            yield sse({"type": "content_block_stop", "index": block}, "content_block_stop")
        for tc in calls:
            idx, n_blocks = n_blocks, n_blocks + 1
            start = {"type": "tool_use", "id": f"toolu_{tc.id[5:]}", "name": tc.name, "input": {}}
            yield sse({"type": "content_block_start", "index": idx, "content_block": start}, "content_block_start")
            yield sse(
                {
                    "type": "content_block_delta",
                    "index": idx,
                    "delta": {"type": "input_json_delta", "partial_json": tc.arguments},
                },
                "content_block_delta",
            )
            yield sse({"type": "content_block_stop", "index": idx}, "content_block_stop")
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": self._stop_reason(c, calls), "stop_sequence": self._stop_sequence(c)},
            "usage": self._anthropic_usage(len(prompt), len(c.token_ids)),  # cumulative, input included
            "token_ids": c.token_ids,
            "logprobs": {"content": self.lp_entries(c)},
            "policy_version": version,
        }
        yield sse(delta, "message_delta")
        yield sse({"type": "message_stop"}, "message_stop")

    async def count_tokens(self, body: dict[str, Any]) -> Response:
        self.model_name(body)
        messages, tools = convert.anthropic_messages(body)
        tools = convert.apply_tool_choice(body, tools, "anthropic")
        prompt = await self.render(messages, tools, convert.anthropic_ending(body, messages))
        return JSONResponse({"input_tokens": len(prompt)})
