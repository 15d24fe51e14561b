"""Fixtures for the real-CLI-harness tests: the three CLIs installed (by the idempotent install script)."""

from __future__ import annotations

import pytest

from tests.cli_harnesses.support import ensure_installed


@pytest.fixture(scope="session")
def cli_installed() -> None:
    """The three CLIs under .node/ (make setup installs them; this only checks, or installs if missing)."""
    ensure_installed()
