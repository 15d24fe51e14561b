"""Fixtures for the sandbox tests: a loopback upstream (standing in for the proxy) and an echo task set."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.sandbox.support import EchoTaskSet, Upstream


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    try:
        yield up
    finally:
        up.close()


@pytest.fixture
def echo() -> EchoTaskSet:
    return EchoTaskSet()
