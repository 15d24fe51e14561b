"""A vLLM-style mock upstream on loopback that answers with production-shaped responses from bench/data.py.

Run: ``python bench/upstream.py PORT [--pool N]``. At start it draws ``N`` small and ``N // 4`` large calls
(different ids, logprobs, texts, tool calls, ~1% upstream errors; see bench/README.md) and answers each
request with the next response of its kind, in turn: a request asking for ``max_tokens`` of at least 1,024
(bench/data.py's large calls ask for 2,048, small ones 256), or without ``max_tokens`` and over 4 KB, gets a
large response. Errors keep their status (500). Raw asyncio, one keep-alive connection per client, so the
upstream costs little beside what it serves; the benches pin it away from the process they measure.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import data

MAX_TOKENS = re.compile(rb'"max_tokens"\s*:\s*(\d+)')
LARGE_MAX_TOKENS = 1024
LARGE_BODY = 4096


def http(status: int, body: bytes) -> bytes:
    reason = b"OK" if status == 200 else b"Internal Server Error"
    head = b"HTTP/1.1 %d %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    return head % (status, reason, len(body)) + body


def pool(kind: str, n: int, seed: int) -> list[bytes]:
    """``n`` full HTTP responses drawn from bench/data.py's ``kind`` calls."""
    return [http(int(h["http_status"]), resp) for h, _, resp in data.calls(n, data.shape(kind), seed=seed)]


def is_large(body: bytes) -> bool:
    m = MAX_TOKENS.search(body, 0, 512) or MAX_TOKENS.search(body)  # data.py puts max_tokens last
    return int(m.group(1)) >= LARGE_MAX_TOKENS if m else len(body) > LARGE_BODY


def body_framing(head: bytes) -> tuple[int, bool]:
    """(Content-Length, chunked) of an HTTP head: how its body is framed (0, False: no body)."""
    clen, chunked = 0, False
    for line in head.split(b"\r\n"):
        low = line.lower()
        if low.startswith(b"content-length:"):
            clen = int(line[15:])
        elif low.startswith(b"transfer-encoding:") and b"chunked" in low:
            chunked = True
    return clen, chunked


class Upstream:
    """Serves the drawn responses in turn, per kind."""

    def __init__(self, n: int, seed: int = 7) -> None:
        self.pools = {False: pool("small", n, seed), True: pool("large", max(1, n // 4), seed + 1)}
        self.next = {False: 0, True: 0}

    def answer(self, body: bytes) -> bytes:
        large = is_large(body)
        items = self.pools[large]
        i = self.next[large]
        self.next[large] = (i + 1) % len(items)
        return items[i]

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                clen, chunked = body_framing(head)
                body = await self._chunked(reader) if chunked else (await reader.readexactly(clen) if clen else b"")
                writer.write(self.answer(body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _chunked(reader: asyncio.StreamReader) -> bytes:
        parts = []
        while n := int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16):
            parts.append((await reader.readexactly(n + 2))[:-2])
        while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
            pass
        return b"".join(parts)


async def serve(port: int, n: int) -> None:
    up = Upstream(n)
    srv = await asyncio.start_server(up.handle, "127.0.0.1", port, backlog=1024)
    sizes = {k: sum(map(len, v)) // len(v) for k, v in up.pools.items()}
    print(f"upstream on {port}: {n} small (mean {sizes[False]:,} B) and {len(up.pools[True])} large responses "
          f"(mean {sizes[True]:,} B) from bench/data.py", flush=True)  # fmt: skip
    async with srv:
        await srv.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("port", type=int)
    ap.add_argument("--pool", type=int, default=1024, help="small responses drawn (large: a quarter)")
    args = ap.parse_args()
    asyncio.run(serve(args.port, args.pool))


if __name__ == "__main__":
    main()
