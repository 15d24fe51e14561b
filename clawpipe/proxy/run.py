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

RESERVED_FDS = 64  # descriptors kept for what is not a connection: segments, logs, the listener, checker pipes


def _raise_fd_limit(wanted: int) -> None:
    """Raise the soft descriptor limit toward the hard one, so the connection caps, not the default soft
    limit (often 1024), decide when the proxy refuses connections."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted + 256  # segments, logs, the listening socket, and room to spare
    if soft != resource.RLIM_INFINITY and soft < target:
        new = target if hard == resource.RLIM_INFINITY else min(hard, target)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


def fit_to_descriptors(cfg: ProxyConfig) -> None:
    """Lower the connection caps to what the descriptor limit holds, when it could not be raised that far.

    Past the limit a new connection cannot even be accepted: it is closed unanswered. Within the caps it is
    answered (a 503 naming the cap) and an upstream connection still opens for the calls admitted.
    """
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    n = max(1, len(cfg.upstreams))
    if soft == resource.RLIM_INFINITY or soft - RESERVED_FDS >= cfg.max_connections + n * cfg.max_upstream_conns:
        return
    budget = max(2 * n, soft - RESERVED_FDS)
    per_upstream = max(1, min(cfg.max_upstream_conns, budget // (2 * n)))  # a call holds a client and an upstream
    clients = max(1, min(cfg.max_connections, budget - n * per_upstream))
    log.warning(
        "descriptor limit %d holds fewer connections than asked: at most %d client connections and %d per "
        "upstream (asked %d and %d); raise ulimit -n for more",
        soft,
        clients,
        per_upstream,
        cfg.max_connections,
        cfg.max_upstream_conns,
    )
    cfg.max_connections, cfg.max_upstream_conns = clients, per_upstream


def run_proxy(config: ProxyConfig | None = None, /, **kwargs: Any) -> None:
    """Run a proxy in the foreground until SIGINT/SIGTERM; logs its URL on start."""
    proxy = ProxyServer(config, **kwargs)
    _raise_fd_limit(proxy.config.max_connections + len(proxy.config.upstreams) * proxy.config.max_upstream_conns)
    fit_to_descriptors(proxy.config)
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
