"""The task-set tests' shared fixture: one bwrap backend per test module (the verifiers' checks run in it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from clawpipe.sandbox.backends import Backend, get_backend


@pytest.fixture(scope="module")
def bwrap() -> Iterator[Backend]:
    backend = get_backend("bwrap")
    try:
        yield backend
    finally:
        backend.close()
