"""Running a capture proxy in the foreground (``clawpipe proxy``): signals, descriptor limit, ready file."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path
from typing import Any

from clawpipe.proxy.config import ProxyConfig
from clawpipe.proxy.loop import new_event_loop
from clawpipe.proxy.server import ProxyServer

log = logging.getLogger(__name__)


def _raise_fd_limit(wanted: int) -> None:
    """Raise the soft descriptor limit toward the hard one, so the connection caps, not the default soft
    limit (often 1024), decide when the proxy refuses connections."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted + 256  # segments, logs, the listening socket
    if soft != resource.RLIM_INFINITY and soft < target:
        new = target if hard == resource.RLIM_INFINITY else min(hard, target)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < target:
            log.warning("descriptor limit %d is below the proxy's connection caps (%d); raise ulimit -n", new, wanted)


def run_proxy(config: ProxyConfig | None = None, /, **kwargs: Any) -> None:
    """Run a proxy in the foreground until SIGINT/SIGTERM; logs its URL on start."""
    proxy = ProxyServer(config, **kwargs)
    _raise_fd_limit(proxy.config.max_connections + len(proxy.config.upstreams) * proxy.config.max_upstream_conns)
    loop = new_event_loop()
    asyncio.set_event_loop(loop)

    def ready() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, proxy.request_stop)
        if proxy.config.ready_file:
            tmp = Path(f"{proxy.config.ready_file}.tmp")
            tmp.write_text(proxy.url)
            tmp.replace(proxy.config.ready_file)  # readers never see a half-written URL

    try:
        loop.run_until_complete(proxy.serve_until_stopped(ready))
    finally:
        loop.close()
