"""Large request bodies are checked in a worker process, so one parse never holds the proxy's event loop.

Every model call's body is parsed once (:func:`clawpipe.proxy.body.read_call_body`). JSON parsers hold the
GIL, so a thread does not help: a 30 MiB body of ``[{},{},...]`` holds the loop ~0.75 s, and every other
rollout's call waits that long. Bodies up to ``inline_max_bytes`` (1 MiB: a few ms at worst) are checked
inline; larger ones go to one long-lived worker (``python -m clawpipe.proxy.checker``), started on first use,
over a length-prefixed pipe protocol, one body at a time. The loop meanwhile serves everything else.

The worker runs the very same function, so an answer (the forwarded bytes, or the 400/415 and its message) is
the one the inline path gives. A worker that dies (killed, out of memory) fails only the body it held, with
a 503 that says to retry, and the next large body starts a fresh one. So does one that takes longer than the
body's time limit (a few seconds plus its size at a pessimistic parse rate: a stopped or wedged worker), which
is killed, so the bodies queued behind it are checked by a fresh one instead of waiting forever. A call
cancelled while the worker holds its body (its client went away) kills the worker too: its answer is still
on the pipe, and the next body must never read it as its own.

Memory: parsing a 30 MiB body of ``[{},...]`` peaks at ~840 MB in the worker, and the worker's RSS falls back
to under 100 MB after it (measured), so the worker is kept between bodies. It exits on end of input, when the
proxy closes its end or dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import signal
import struct
import sys

import msgspec

from clawpipe import capture
from clawpipe.proxy.body import CallBody, read_call_body
from clawpipe.proxy.wire import BadRequest

log = logging.getLogger(__name__)

INLINE_MAX_BYTES = 1 << 20
# a body's time limit: BASE_LIMIT_S (a worker's start, a loaded machine) plus its size at LIMIT_BYTES_PER_S,
# a tenth of the rate measured for the slowest JSON (30 MiB of `[{},...]` in 1.5 s on a loaded 2-core machine)
BASE_LIMIT_S = 5.0
LIMIT_BYTES_PER_S = 2 << 20
_NONE = 0xFFFFFFFF  # a length meaning "no value"
_ASK = struct.Struct("<IIQ")  # api length, content-encoding length, body length
_OK = struct.Struct("<BIIQ")  # stream, model length, request_changes length, forwarded length
_BAD = struct.Struct("<HI")  # status, message length
_NO_RESOURCES = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN))  # a worker cannot start
_KIND_OK, _KIND_BAD = b"o", b"b"


def _opt(value: bytes | None) -> tuple[int, bytes]:
    return (_NONE, b"") if value is None else (len(value), value)


def check_to_bytes(api: str, body: bytes, coding: bytes | None) -> bytes:
    """The answer for one body, as the worker writes it."""
    try:
        checked = read_call_body(api, body, coding)
    except BadRequest as exc:
        msg = str(exc).encode()
        return _KIND_BAD + _BAD.pack(exc.status, len(msg)) + msg
    n_model, model = _opt(None if checked.model is None else checked.model.encode())
    n_changes, changes = _opt(None if checked.request_changes is None else bytes(checked.request_changes))
    head = _OK.pack(checked.stream, n_model, n_changes, len(checked.forwarded))
    return _KIND_OK + head + model + changes + checked.forwarded


class BodyChecker:
    """Checks call bodies: small ones inline, large ones in the worker process (see the module docstring)."""

    def __init__(
        self,
        inline_max_bytes: int = INLINE_MAX_BYTES,
        base_limit_s: float = BASE_LIMIT_S,
        limit_bytes_per_s: float = LIMIT_BYTES_PER_S,
    ) -> None:
        self.inline_max_bytes = inline_max_bytes
        self.base_limit_s = base_limit_s
        self.limit_bytes_per_s = limit_bytes_per_s
        self.offloaded = 0  # bodies checked by the worker
        self.worker_restarts = 0
        self.timeouts = 0  # bodies whose check ran past its time limit
        self._proc: asyncio.subprocess.Process | None = None
        self._lock: asyncio.Lock | None = None
        self._reaping: set[asyncio.Task[int]] = set()

    @property
    def busy(self) -> bool:
        """Whether the worker holds a body now (or one waits for it)."""
        return self._lock is not None and self._lock.locked()

    def time_limit_s(self, n_bytes: int) -> float:
        """How long the worker may take over a body of `n_bytes` before it is killed and the call gets a 503."""
        return self.base_limit_s + n_bytes / self.limit_bytes_per_s

    async def check(self, api: str, body: bytes, coding: bytes | None) -> CallBody:
        """The checked body; raises :class:`BadRequest` as :func:`read_call_body` does (or 503: worker lost)."""
        if len(body) <= self.inline_max_bytes:
            return read_call_body(api, body, coding)
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # one body at a time on the pipe; a call cancelled while waiting here sent nothing
            self.offloaded += 1
            limit = self.time_limit_s(len(body))
            try:
                return await asyncio.wait_for(self._ask(api, body, coding), limit)
            except TimeoutError as exc:
                self.timeouts += 1
                self._kill()
                log.warning("body checker took over %.1f s for a %d-byte body; worker killed", limit, len(body))
                raise BadRequest(
                    503, f"the proxy's body checker took over {limit:.0f} s to read this request; send it again"
                ) from exc
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                self._kill()
                log.warning("body checker worker lost while checking a %d-byte body: %r", len(body), exc)
                if isinstance(exc, WorkerNotStarted):
                    raise BadRequest(503, f"{exc}; send it again") from exc
                raise BadRequest(
                    503, "the proxy's body checker stopped while reading this request; send it again"
                ) from exc
            except asyncio.CancelledError:
                # the body may be half sent, or its answer unread: either would be read by the next body
                self._kill()
                raise

    async def _ask(self, api: str, body: bytes, coding: bytes | None) -> CallBody:
        proc = await self._worker()
        assert proc.stdin is not None and proc.stdout is not None
        api_b, coding_b = api.encode(), coding or b""
        proc.stdin.write(_ASK.pack(len(api_b), len(coding_b), len(body)) + api_b + coding_b)
        proc.stdin.write(body)
        await proc.stdin.drain()
        out = proc.stdout
        kind = await out.readexactly(1)
        if kind == _KIND_BAD:
            status, n = _BAD.unpack(await out.readexactly(_BAD.size))
            raise BadRequest(status, (await out.readexactly(n)).decode())
        if kind != _KIND_OK:
            raise ValueError(f"body checker answered {kind!r}")
        stream, n_model, n_changes, n_fwd = _OK.unpack(await out.readexactly(_OK.size))
        model = None if n_model == _NONE else (await out.readexactly(n_model)).decode()
        changes = None if n_changes == _NONE else msgspec.Raw(await out.readexactly(n_changes))
        forwarded = await out.readexactly(n_fwd)
        return CallBody(forwarded, bool(stream), model, changes)

    async def _worker(self) -> asyncio.subprocess.Process:
        proc = self._proc
        if proc is not None and proc.returncode is None:
            return proc
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",  # not `-m`: the package imports this module first, and runpy warns on every start
                "from clawpipe.proxy.checker import worker_main; worker_main()",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                limit=1 << 16,
            )
        except OSError as exc:
            raise WorkerNotStarted(f"the proxy could not start its body checker: {_start_failure(exc)}") from exc
        return self._proc

    def _kill(self) -> None:
        """Kill a worker whose pipe is out of step (failed, too slow, or its call cancelled mid-answer) and reap
        it in the background (this may run while the calling task is being cancelled); the next large body
        starts a fresh one."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        self.worker_restarts += 1
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        task = asyncio.ensure_future(proc.wait())
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    @property
    def worker_pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    async def close(self) -> None:
        """Stop the worker (it also exits by itself when the proxy's end of the pipe closes)."""
        proc, self._proc = self._proc, None
        if self._reaping:
            await asyncio.gather(*self._reaping, return_exceptions=True)
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


class WorkerNotStarted(OSError):
    """The body checker's worker process could not be started (no descriptor or process left, say)."""


def _start_failure(exc: OSError) -> str:
    """Why a worker did not start, for a person: the error, and the descriptors the proxy holds when that is
    near its limit (uvloop reports a spawn that ran out of descriptors without the errno)."""
    if exc.errno in _NO_RESOURCES:
        return capture.write_failure(exc, ".")
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        held = len(os.listdir("/proc/self/fd"))
    except OSError:
        return str(exc)
    if soft != resource.RLIM_INFINITY and held >= soft - 8:
        return f"{exc}: the proxy holds {held} of its {soft} file descriptors (RLIMIT_NOFILE); raise ulimit -n"
    return str(exc)


def _read_exactly(stream: object, n: int) -> bytes:
    read = stream.read  # type: ignore[attr-defined]
    parts, left = [], n
    while left:
        chunk = read(left)
        if not chunk:
            raise EOFError
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def worker_main() -> None:
    """The worker: check bodies from stdin until it closes, each answer flushed to stdout."""
    # Ctrl-C on the proxy's terminal reaches the whole process group: the proxy stops the worker itself (or
    # its death closes the pipe), so the worker ignores it rather than dying with a traceback mid-body
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            n_api, n_coding, n_body = _ASK.unpack(_read_exactly(stdin, _ASK.size))
            api = _read_exactly(stdin, n_api).decode()
            coding = _read_exactly(stdin, n_coding) or None
            body = _read_exactly(stdin, n_body)
        except EOFError:
            return
        try:
            stdout.write(check_to_bytes(api, body, coding))
            stdout.flush()
        except BrokenPipeError:  # the proxy went away mid-body: nobody to answer
            os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())  # nor at exit, when stdout is flushed
            return
        del body


if __name__ == "__main__":
    worker_main()
