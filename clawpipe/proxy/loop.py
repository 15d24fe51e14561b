"""The proxy's event loops: uvloop's when installed, and a coroutine served on one in a thread of its own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

from clawpipe.errors import ClawpipeError

Serve = Callable[[Callable[[], None]], Awaitable[None]]  # serve(ready): calls ready() once it is up


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when installed (lower CPU per call), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """Runs ``serve(ready)`` on a fresh event loop in a daemon thread.

    :meth:`start` returns once ``serve`` called ``ready()``, and raises what it raised before that (a port in
    use, say); :meth:`join` waits for ``serve`` to return.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, serve: Serve, timeout_s: float) -> None:
        self._thread = threading.Thread(target=self._main, args=(serve,), name=self.name, daemon=True)
        self._thread.start()
        self._ready.wait(timeout_s)
        if self._error is not None:
            raise self._error
        if not self._ready.is_set():
            raise ClawpipeError(f"{self.name} did not start within {timeout_s:g} s")

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _main(self, serve: Serve) -> None:
        loop = new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(serve(self._ready.set))
        except BaseException as exc:
            if self._ready.is_set():
                raise
            self._error = exc  # start() raises it in the caller's thread
            self._ready.set()
        finally:
            loop.close()
