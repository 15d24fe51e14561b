"""Large request bodies are checked in the proxy's worker process: same answers, and the loop keeps serving."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
from typing import Any

import httpx
import pytest

from clawpipe.proxy.body import read_call_body
from clawpipe.proxy.checker import BodyChecker
from clawpipe.proxy.wire import BadRequest
from tests.proxy.conftest import ProxyHandle

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def _bodies() -> list[tuple[str, bytes, bytes | None]]:
    """(api, body, content-encoding): accepted ones of every kind and each way a body is refused."""
    long_text = "word " * 60_000
    return [
        ("chat", json.dumps(CHAT).encode(), None),
        ("chat", json.dumps({**CHAT, "stream": True, "logprobs": False}).encode(), None),
        ("chat", json.dumps({**CHAT, "messages": [{"role": "user", "content": long_text}]}).encode(), None),
        ("completions", json.dumps({"model": "m", "prompt": "a b c", "return_token_ids": True}).encode(), None),
        ("messages", json.dumps({"model": "m", "max_tokens": 5, "messages": CHAT["messages"]}).encode(), None),
        ("embeddings", json.dumps({"model": "m", "input": "x"}).encode(), None),
        ("chat", b"\xef\xbb\xbf" + json.dumps(CHAT).encode(), None),
        ("chat", b'{"model": "m", "messages": [}', None),
        ("chat", b'{"model": "m", "x": NaN}', None),
        ("chat", b'{"model": "m", "x": 1e999}', None),
        ("chat", b'{"model": "m", "x": "\xff"}', None),
        ("chat", b'[{"model": "m"}]', None),
        ("chat", json.dumps({**CHAT, "stream": "true"}).encode(), None),
        ("chat", json.dumps(CHAT).encode(), b"gzip"),
        ("chat", b"[" * 200_000 + b"]" * 200_000, None),
    ]


def _outcome(fn: Any) -> tuple[Any, ...]:
    """What a check answered, comparable between the inline path and the worker."""
    try:
        got = fn()
    except BadRequest as exc:
        return ("refused", exc.status, str(exc))
    changes = None if got.request_changes is None else bytes(got.request_changes)
    return ("ok", got.forwarded, got.stream, got.model, changes)


async def _async_outcome(coro: Any) -> tuple[Any, ...]:
    try:
        got = await coro
    except BadRequest as exc:
        return ("refused", exc.status, str(exc))
    return _outcome(lambda: got)


def test_the_worker_gives_the_inline_answer_for_every_body() -> None:
    checker = BodyChecker(inline_max_bytes=0)  # every body goes to the worker

    async def run() -> list[tuple[Any, ...]]:
        out = []
        for api, body, coding in _bodies():
            out.append(await _async_outcome(checker.check(api, body, coding)))
        await checker.close()
        return out

    worker = asyncio.run(run())
    inline = [_outcome(lambda a=a, b=b, c=c: read_call_body(a, b, c)) for a, b, c in _bodies()]
    assert worker == inline
    assert checker.offloaded == len(inline)
    assert {o[0] for o in inline} == {"ok", "refused"} and sum(o[0] == "refused" for o in inline) == 9


def _dense_body(mib: int) -> bytes:
    """A valid chat body whose ``metadata`` is ``mib`` MiB of empty objects: the slowest JSON to parse."""
    head = json.dumps(CHAT)[:-1].encode() + b', "metadata": ['
    n = (mib << 20) // 3
    return head + b"{}," * n + b"{}]}"


def test_a_worker_killed_mid_body_fails_only_that_body_and_the_next_starts_a_fresh_one() -> None:
    checker = BodyChecker(inline_max_bytes=0)
    body = _dense_body(24)

    async def run() -> tuple[tuple[Any, ...], tuple[Any, ...], int | None, int | None]:
        first = await _async_outcome(checker.check("chat", json.dumps(CHAT).encode(), None))  # starts the worker
        pid = checker.worker_pid
        task = asyncio.ensure_future(_async_outcome(checker.check("chat", body, None)))
        await asyncio.sleep(0.2)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        lost = await task
        again = await _async_outcome(checker.check("chat", json.dumps(CHAT).encode(), None))
        new_pid = checker.worker_pid
        await checker.close()
        assert first == again and first[0] == "ok"
        return lost, again, pid, new_pid

    lost, _, pid, new_pid = asyncio.run(run())
    assert lost[:2] == ("refused", 503) and "send it again" in lost[2]
    assert new_pid is not None and new_pid != pid
    assert checker.worker_restarts == 1


def _path(proxy: ProxyHandle, rollout: str) -> str:
    return proxy.openai_base(rollout).removeprefix(proxy.url) + "/chat/completions"


def _post(proxy: ProxyHandle, path: str, body: bytes, *, close: bool = True) -> socket.socket:
    """A connection to the proxy on which one JSON POST of `body` has been sent."""
    host, port = proxy.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=60)
    ending = "connection: close\r\n" if close else ""
    head = (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{ending}\r\n"
    ).encode()
    s.sendall(head + body)
    return s


def _send_raw(proxy: ProxyHandle, path: str, body: bytes, out: list[bytes]) -> None:
    with _post(proxy, path, body) as s:
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
        out.append(data)


@pytest.mark.slow
def test_a_slow_to_parse_body_does_not_hold_other_calls(proxy: ProxyHandle, upstream: Any) -> None:
    """While the worker parses a 24 MiB body of empty objects (~0.7-1.5 s of parsing), small calls of another
    rollout go on being answered: several start and finish while the worker holds the big body. Inline, the
    proxy's loop answered nothing for the whole parse. (Counted, not timed: load slows both sides alike.)

    The body ends in one stray byte, so the parser reads all of it before refusing it and the scripted
    upstream, which runs in this process, never parses it (its parse would hold this process's GIL)."""
    body = _dense_body(24) + b"x"
    checker = proxy.server.calls.checker
    base = proxy.openai_base("small")
    with httpx.Client(timeout=60) as client:
        client.post(f"{base}/chat/completions", json=CHAT).raise_for_status()  # warm: connection, first call
        got: list[bytes] = []
        sender = threading.Thread(target=_send_raw, args=(proxy, _path(proxy, "big"), body, got))
        sender.start()
        during = after = 0
        while sender.is_alive():
            busy_before = checker.busy
            client.post(f"{base}/chat/completions", json=CHAT).raise_for_status()
            if busy_before and checker.busy:
                during += 1  # started and answered while the worker held the big body
            else:
                after += 1
        sender.join()
    assert got and got[0].startswith(b"HTTP/1.1 400"), got[0][:200] if got else "no answer"
    assert b"not valid JSON" in got[0]
    assert during >= 3, (during, after)
    stats = proxy.server.snapshot_stats()
    assert stats["bodies_checked_in_worker"] == 1
    big = [r for r in proxy.records() if r.header["rollout_id"] == "big"]
    assert len(big) == 1 and big[0].header["http_status"] == 400 and "not valid JSON" in big[0].header["error"]
