"""The capture proxy room: forwards harness model calls to the policy servers and records each one durably.

Public API: :class:`ProxyServer` (``start()`` in a background thread / ``stop()``), :class:`ProxyConfig`,
and :func:`run_proxy` (blocking, for the CLI). See ``clawpipe/proxy/server.py`` for the guarantees.
"""

from __future__ import annotations

from clawpipe.proxy.config import ProxyConfig
from clawpipe.proxy.run import run_proxy
from clawpipe.proxy.server import ProxyServer

__all__ = ["ProxyConfig", "ProxyServer", "run_proxy"]
