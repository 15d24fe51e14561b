"""OpenAI legacy Completions routes (stream and not), one prompt or a list of them, with token ids and logprobs.

A list of prompts runs as one request per prompt (batched by the engine like any others); the choices are
indexed across prompts as OpenAI and vLLM do (prompt i, choice k -> index i x n + k). With one prompt its ids are
the top-level `prompt_token_ids`; with several, each choice carries its own prompt's ids (vLLM's placement).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response

from clawpipe.serving import convert
from clawpipe.serving.params import RequestError, SamplingParams
from clawpipe.serving.routes import Choice, Routes, sse
from clawpipe.serving.text import new_id

MAX_PROMPTS = 128  # prompts in one request (each takes its n rows in the batch)


class CompletionsRoutes(Routes):
    """POST /v1/completions."""

    async def completions(self, body: dict[str, Any]) -> Response:
        model = self.model_name(body)
        _check_unsupported(body)
        special = body.get("add_special_tokens", True)  # vLLM's field; as vLLM, a BOS the tokenizer adds is kept
        if not isinstance(special, bool):
            raise RequestError("'add_special_tokens' must be true or false", param="add_special_tokens")
        prompts = await asyncio.to_thread(self._completion_prompts, body.get("prompt"), special)  # see Routes.render
        n = convert.int_field(body, "n")
        logprobs = body.get("logprobs")  # legacy: the number of top alternatives (0-5); false/null: none
        if logprobs is not None and not isinstance(logprobs, bool | int):
            raise RequestError("'logprobs' must be an integer (0-5) or null")
        top = 0 if isinstance(logprobs, bool) or logprobs is None else logprobs
        if not 0 <= top <= 5:
            raise RequestError(f"'logprobs' must be in [0, 5], got {top}")
        max_tokens, stop = convert.int_field(body, "max_tokens"), convert.stop_list(body.get("stop"))
        params = [self._checked(body, i, p, max_tokens, stop, n, top, len(prompts)) for i, p in enumerate(prompts)]
        want_lp = (logprobs is not None and logprobs is not False) or bool(body.get("return_token_ids"))
        base = {"id": f"cmpl-{new_id('', 12)}", "object": "text_completion", "created": int(time.time())}
        base["model"] = model
        if body.get("stream"):
            return self.sse_response(self._completions_stream(prompts, params, base, want_lp, body))
        tasks = [asyncio.ensure_future(self.run(p, pp, False)) for p, pp in zip(prompts, params, strict=True)]
        try:
            results = await asyncio.gather(*tasks)
        finally:  # one failing prompt (or the client leaving) ends the others
            for t in tasks:
                t.cancel()
        single = len(prompts) == 1
        choices = [
            {
                "index": i * pp.n + c.index,
                "text": c.text,
                "logprobs": self._completion_lp(c, 0) if want_lp else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stopped_on,
                "token_ids": c.token_ids,
                **({} if single else {"prompt_token_ids": prompts[i]}),
            }
            for i, ((_, cs), pp) in enumerate(zip(results, params, strict=True))
            for c in cs
        ]
        return JSONResponse(
            {
                **base,
                "choices": choices,
                "usage": self._usage(prompts, [c for _, cs in results for c in cs]),
                "prompt_token_ids": prompts[0] if single else None,
                "policy_version": max(v for v, _ in results),
            }
        )

    def _checked(
        self,
        body: dict[str, Any],
        i: int,
        prompt: list[int],
        max_tokens: int | None,
        stop: list[str],
        n: int | None,
        top: int,
        count: int,
    ) -> SamplingParams:
        """One prompt's parameters, checked; with several prompts the error names which one is at fault."""
        try:
            return self.build_params(body, prompt, max_tokens, stop, n, top)
        except RequestError as exc:
            if count == 1:
                raise
            raise RequestError(f"prompt[{i}]: {exc}", status=exc.status, param="prompt") from exc

    @staticmethod
    def _usage(prompts: list[list[int]], choices: list[Choice]) -> dict[str, int]:
        n_in, n_out = sum(len(p) for p in prompts), sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

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

    def _completion_prompts(self, prompt: Any, special: bool = True) -> list[list[int]]:
        """The request's prompts as token ids: a string, a list of ids, or a list of either. special: strings are
        encoded with the special tokens the tokenizer adds around a text (a BOS for Llama-style tokenizers), as
        vLLM encodes completions prompts by default; a model trained with a BOS at the start expects it."""
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_ids(prompt)):
            return [self._one_prompt(prompt, "prompt", special)]
        if not isinstance(prompt, list) or not prompt:
            raise RequestError("'prompt' must be a string, a list of token ids, or a non-empty list of either")
        if len(prompt) > MAX_PROMPTS:
            raise RequestError(f"'prompt' has {len(prompt)} prompts; send at most {MAX_PROMPTS} per request")
        return [self._one_prompt(p, f"prompt[{i}]", special) for i, p in enumerate(prompt)]

    def _one_prompt(self, prompt: Any, where: str, special: bool) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError(f"'{where}' is empty")
            self.check_text(len(prompt))
            return list(self.engine.tokenizer.encode(prompt, add_special_tokens=special))
        if isinstance(prompt, list) and prompt and _is_ids(prompt):
            return list(prompt)
        raise RequestError(f"'{where}' must be a non-empty string or a non-empty list of token ids")

    async def _completions_stream(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        base: dict[str, Any],
        want_lp: bool,
        body: dict[str, Any],
    ) -> AsyncIterator[bytes]:
        single = len(prompts) == 1
        choices = [[Choice(k, False) for k in range(pp.n)] for pp in params]
        streams = [self.engine.stream(p, pp) for p, pp in zip(prompts, params, strict=True)]
        async with contextlib.aclosing(_merged(streams)) as merged:
            async for i, item in merged:
                if isinstance(item, tuple):
                    base["policy_version"] = max(item[1], base.get("policy_version", item[1]))
                    first = {**base, "choices": []}
                    if single:
                        first["prompt_token_ids"] = prompts[0]
                    else:  # each prompt's ids open its choices
                        first["choices"] = [
                            {"index": i * params[i].n + k, "text": "", "prompt_token_ids": prompts[i]}
                            for k in range(params[i].n)
                        ]
                    yield sse(first)
                    continue
                out = []
                for ev in item:
                    c = choices[i][ev.index]
                    start = len(c.token_ids)
                    piece = c.add(ev)
                    out.append(
                        {
                            "index": i * params[i].n + c.index,
                            "text": piece,
                            "logprobs": self._completion_lp(c, start) if want_lp else None,
                            "finish_reason": c.finish_reason,
                            "stop_reason": c.stopped_on,
                            "token_ids": c.token_ids[start:],
                        }
                    )
                chunk = {**base, "choices": out}
                opts = body.get("stream_options") or {}
                if opts.get("include_usage") and opts.get("continuous_usage_stats"):  # vLLM's running count
                    chunk["usage"] = self._usage(prompts, [c for cs in choices for c in cs])
                yield sse(chunk)
        if (body.get("stream_options") or {}).get("include_usage"):
            yield sse({**base, "choices": [], "usage": self._usage(prompts, [c for cs in choices for c in cs])})
        yield b"data: [DONE]\n\n"


def _check_unsupported(body: dict[str, Any]) -> None:
    """RequestError for legacy fields whose answer would silently differ: echo (the prompt in the text, scored)
    and suffix (insertion)."""
    if body.get("echo") not in (None, False):
        raise RequestError(
            "'echo' is not supported: this engine does not return or score the prompt; drop echo (the prompt's ids "
            "are in prompt_token_ids)",
            param="echo",
        )
    if body.get("suffix") not in (None, ""):
        raise RequestError("'suffix' (insertion) is not supported by this engine; drop it", param="suffix")


def _is_ids(value: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


async def _merged(streams: list[AsyncGenerator[Any, None]]) -> AsyncGenerator[tuple[int, Any], None]:
    """(stream index, item) from several streams as their items arrive; the first error ends them all."""
    if len(streams) == 1:  # the common case: no tasks, no extra hop
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncGenerator[Any, None]) -> None:
        try:
            async with contextlib.aclosing(stream) as s:
                async for item in s:
                    await queue.put((i, item))
            await queue.put((i, done))
        except Exception as exc:  # handed to the consumer, which ends the others
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
