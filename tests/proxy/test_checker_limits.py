"""The body checker's worker under stress: a wedged worker is killed at the body's time limit and the bodies
queued behind it are answered by a fresh one; a call cancelled mid-check never hands its answer to the next
body; the worker goes when the proxy stops or dies; and its memory comes back after a huge body."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from clawpipe.proxy.checker import BodyChecker
from clawpipe.proxy.wire import BadRequest


def _chat(model: str, pad: int = 0) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "metadata": {"pad": "x" * pad}}
    return json.dumps(body).encode()


def _dense(model: str, mib: int) -> bytes:
    """A valid chat body padded with `mib` MiB of empty objects: the slowest JSON to parse."""
    head = _chat(model)[:-1] + b', "extra": ['
    return head + b"{}," * ((mib << 20) // 3) + b"{}]}"


async def _outcome(coro: Any) -> tuple[Any, ...]:
    try:
        got = await coro
    except BadRequest as exc:
        return ("refused", exc.status, str(exc))
    return ("ok", got.model)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_stopped_worker_is_killed_at_the_time_limit_and_queued_bodies_are_answered() -> None:
    """The worker is SIGSTOPped holding a body: that call gets a 503 once its limit (1 s here) passes, and the
    two bodies queued behind it are checked by a fresh worker, each answered with its own model."""
    checker = BodyChecker(inline_max_bytes=0, base_limit_s=1.0, limit_bytes_per_s=1 << 30)

    async def run() -> tuple[list[tuple[Any, ...]], float, int | None]:
        await checker.check("chat", _chat("warm"), None)
        pid = checker.worker_pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        calls = [_outcome(checker.check("chat", _chat(m), None)) for m in ("held", "second", "third")]
        got = await asyncio.wait_for(asyncio.gather(*calls), 30)
        elapsed = time.monotonic() - t0
        await checker.close()
        return list(got), elapsed, pid

    got, elapsed, pid = asyncio.run(run())
    assert got[0][:2] == ("refused", 503) and "took over 1 s" in got[0][2] and "send it again" in got[0][2]
    assert got[1:] == [("ok", "second"), ("ok", "third")]
    assert elapsed < 20  # never the 30 s of a worker nobody stopped
    assert (checker.timeouts, checker.worker_restarts) == (1, 1)
    assert pid is not None and not _alive(pid)


def test_the_time_limit_grows_with_the_body() -> None:
    checker = BodyChecker()
    assert checker.time_limit_s(0) == checker.base_limit_s
    assert checker.time_limit_s(30 << 20) == pytest.approx(checker.base_limit_s + (30 << 20) / (2 << 20))


@pytest.mark.parametrize("wait_s", [0.0, 0.05, 0.2])
def test_a_call_cancelled_mid_check_does_not_hand_its_answer_to_the_next(wait_s: float) -> None:
    """A call cancelled while its 24 MiB body is being sent or parsed (its client went away; parsing it takes
    the worker well over the longest wait here, even on a fast machine): the next bodies get their own
    answers, never the cancelled one's."""
    checker = BodyChecker(inline_max_bytes=0)

    async def run() -> list[tuple[Any, ...]]:
        await checker.check("chat", _chat("warm"), None)
        gone = asyncio.ensure_future(checker.check("chat", _dense("gone", 24), None))
        await asyncio.sleep(wait_s)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        got = [await _outcome(checker.check("chat", _chat(m, 2 << 20), None)) for m in ("next", "after")]
        await checker.close()
        return got

    assert asyncio.run(run()) == [("ok", "next"), ("ok", "after")]


def test_the_worker_exits_when_the_proxy_process_is_killed(tmp_path: Path) -> None:
    """A process holding a checker (as the proxy does) is SIGKILLed while its worker parses a body: the worker
    sees its input close and exits, leaving no orphan."""
    script = tmp_path / "holder.py"
    script.write_text(
        "import asyncio, sys\n"
        "from clawpipe.proxy.checker import BodyChecker\n"
        "from tests.proxy.test_checker_limits import _chat, _dense\n"
        "async def main():\n"
        "    c = BodyChecker(inline_max_bytes=0)\n"
        "    await c.check('chat', _chat('warm'), None)\n"
        "    print(c.worker_pid, flush=True)\n"
        "    await c.check('chat', _dense('big', 24), None)\n"
        "asyncio.run(main())\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    holder = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, cwd=root, env=env, text=True)
    assert holder.stdout is not None
    worker = int(holder.stdout.readline())
    time.sleep(0.1)
    holder.kill()
    holder.wait()
    deadline = time.monotonic() + 15
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.slow
def test_the_workers_memory_comes_back_after_a_30_mib_body() -> None:
    """Parsing 30 MiB of `[{},...]` peaks at hundreds of MB in the worker; after it the worker holds little, so
    it is kept (not restarted) between bodies."""
    checker = BodyChecker(inline_max_bytes=0)

    async def run() -> tuple[float, float, int | None, int | None]:
        await checker.check("chat", _chat("warm"), None)
        pid = checker.worker_pid
        assert pid is not None
        before = _rss_mb(pid)
        assert (await checker.check("chat", _dense("big", 30), None)).model == "big"
        after = _rss_mb(pid)
        again = checker.worker_pid
        await checker.close()
        return before, after, pid, again

    before, after, pid, again = asyncio.run(run())
    assert again == pid and checker.worker_restarts == 0
    assert after < before + 150, (before, after)
