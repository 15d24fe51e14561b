"""Settings of one capture proxy (``clawpipe proxy`` flags map one to one), checked when made."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from clawpipe.errors import ConfigError
from clawpipe.proxy.limits import MAX_POLICY_VERSION, valid_policy_version


@dataclass
class ProxyConfig:
    """Settings of one proxy instance (CLI flags map one to one)."""

    upstreams: Sequence[str]
    capture_dir: str | os.PathLike[str]
    host: str = "127.0.0.1"
    port: int = 0
    secret: bytes | None = None  # None: Settings().secret()
    admin_token: str | None = None  # None: Settings().admin()
    instance: str | None = None  # segment name prefix; default p<pid>-<random>
    max_body_bytes: int = 32 << 20
    max_buffered_bytes: int = 128 << 20  # request bodies still being received, all connections together
    max_response_bytes: int = 256 << 20  # a larger upstream response ends the call as an upstream error
    max_connections: int = 4096  # open client connections; more get a 503
    max_upstream_conns: int = 256  # connections per upstream replica; more calls wait for one
    header_timeout_s: float = 30.0  # a request head (from connect or its first byte), and any pause in a body
    idle_timeout_s: float = 120.0  # a keep-alive connection with no request for this long is closed
    upstream_timeout_s: float = 600.0  # max silence from the upstream (before the head and between bytes)
    connect_timeout_s: float = 5.0
    replica_backoff_s: float = 5.0  # a failed upstream replica is skipped this long (doubling while it fails)
    pause_wait_s: float = 120.0  # how long a new call waits during a pause before a 503
    drain_timeout_s: float = 120.0  # how long /admin/pause and shutdown wait for in-flight calls
    segment_max_bytes: int = 64 << 20
    segment_max_age_s: float = 300.0
    fsync: bool = True
    tokenizer_dir: str | os.PathLike[str] | None = None
    policy_version: int = 0
    upstream_api_key: str | None = None  # sent as Bearer to the upstream (vLLM --api-key)
    ready_file: str | os.PathLike[str] | None = None  # run_proxy writes the base URL here once listening

    def __post_init__(self) -> None:
        if not self.upstreams:
            raise ConfigError("give at least one upstream (--upstream http://HOST:PORT)")
        positive = (
            "max_body_bytes",
            "max_buffered_bytes",
            "max_response_bytes",
            "max_connections",
            "max_upstream_conns",
            "header_timeout_s",
            "idle_timeout_s",
            "upstream_timeout_s",
            "replica_backoff_s",
        )
        bad = [name for name in positive if not getattr(self, name) > 0]
        if bad:
            raise ConfigError(f"proxy settings {bad} must be positive")
        if not valid_policy_version(self.policy_version):
            raise ConfigError(f"policy_version must be an integer in [0, {MAX_POLICY_VERSION}]")
