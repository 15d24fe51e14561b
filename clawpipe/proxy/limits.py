"""Limits the proxy applies across connections: the request-body budget and the policy_version range."""

from __future__ import annotations

# The largest policy_version the proxy stamps: int32's range, the narrowest integer column a capture's
# integers land in, so one bound holds wherever the proxy accepts a version (config, CLI, admin endpoints).
MAX_POLICY_VERSION = 2**31 - 1
# The slowest average a request body may arrive at once its first --header-timeout seconds are over: bodies
# come from harnesses on the same host, and a body trickled in would otherwise hold its share of the body
# budget for as long as its sender likes.
MIN_BODY_RATE = 1 << 20  # bytes per second


def valid_policy_version(value: object) -> bool:
    """A policy_version the proxy accepts: an int (not a bool) in [0, MAX_POLICY_VERSION]."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_POLICY_VERSION


class BodyBudget:
    """Bytes of request bodies still being received, across all connections, kept under ``limit``.

    A connection reserves what it buffers as the body's bytes arrive (a declared Content-Length reserves
    nothing by itself) and gives it back once the body is complete or the connection ends, so unfinished
    uploads cannot make the proxy buffer more than ``limit`` bytes between them.
    """

    __slots__ = ("limit", "peak", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0

    def fits(self, n: int) -> bool:
        """Whether ``n`` more bytes fit now (nothing is reserved)."""
        return self.used + n <= self.limit

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        return True

    def give(self, n: int) -> None:
        self.used -= n
