"""A closed-loop chat load for a serving endpoint: ``clients`` concurrent loops of chat requests.

Used by the serving benchmark and the GPU check to measure requests/s and generated tokens/s. Every
request has its own prompt and seed, so no two are alike and the prefix cache cannot answer them all.
"""

from __future__ import annotations

import asyncio
import time

import httpx


async def drive_chat(
    url: str, clients: int, seconds: float, *, max_tokens: int = 64, timeout: float = 300.0
) -> dict[str, float]:
    """Chat requests from ``clients`` loops for ``seconds``; returns req/s, generated tok/s and the count."""
    done = tokens = 0
    stop_at = time.monotonic() + seconds

    async def loop(i: int, client: httpx.AsyncClient) -> None:
        nonlocal done, tokens
        k = 0
        while time.monotonic() < stop_at:
            r = await client.post(
                f"{url}/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": f"Guess a number, try {k} of client {i}."}],
                    "max_tokens": max_tokens,
                    "temperature": 1.0,
                    "seed": i * 100_000 + k,
                },
            )
            r.raise_for_status()
            done += 1
            tokens += r.json()["usage"]["completion_tokens"]
            k += 1

    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        await asyncio.gather(*[loop(i, client) for i in range(clients)])
    elapsed = time.monotonic() - t0
    return {"req_s": round(done / elapsed, 2), "tok_s": round(tokens / elapsed, 1), "requests": done}
