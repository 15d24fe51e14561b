"""Fixtures for the real-CLI-harness tests: the CLIs installed (idempotent script), a scripted upstream."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cli_harnesses.scripted_upstream import ScriptedUpstream
from tests.cli_harnesses.support import ensure_installed


@pytest.fixture(scope="session")
def cli_installed() -> None:
    """The three CLIs under .node/ (make setup installs them; this only checks, or installs if missing)."""
    ensure_installed()


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(model="tiny") as up:
        yield up
