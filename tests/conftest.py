"""Shared fixtures: an isolated project home, a private Docker engine, and resource markers.

Markers: ``docker`` and ``sandbox`` tests run in ``make test``. Under CI (CI=true) a missing engine or
missing bubblewrap is a failure, never a silent skip; elsewhere such tests skip with the fix in the reason.
``gpu`` tests run only where CUDA is available.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.s3 import s3_bucket, s3_server  # noqa: F401  (one S3 server for the session, every directory)

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _missing(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"{reason} (CI must run this test)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh CLAWPIPE_HOME; the settings cache is cleared before and after."""
    from clawpipe import config

    h = tmp_path / "home"
    monkeypatch.setenv("CLAWPIPE_HOME", str(h))
    config.get_settings.cache_clear()
    yield h
    config.get_settings.cache_clear()


@pytest.fixture(scope="session")
def docker_host() -> Iterator[str]:
    """DOCKER_HOST of a working engine: the user's, or a private dockerd started for this session."""
    from tests.support.dockerd import PrivateDockerd, engine_answers

    existing = os.environ.get("DOCKER_HOST")
    if engine_answers(existing):
        yield existing or "unix:///var/run/docker.sock"
        return
    if shutil.which("dockerd") is None:
        _missing("no Docker engine and no dockerd: apt-get install -y docker.io (make setup does this as root)")
    if os.geteuid() != 0:
        _missing("a private dockerd needs root here")
    engine = PrivateDockerd()
    try:
        host = engine.start()
    except RuntimeError as exc:
        engine.stop()
        _missing(f"private dockerd failed to start: {exc}")
    os.environ["DOCKER_HOST"] = host
    try:
        yield host
    finally:
        os.environ.pop("DOCKER_HOST", None)
        engine.stop()


@pytest.fixture(autouse=True)
def _resource_markers(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("sandbox") and shutil.which("bwrap") is None:
        _missing("bubblewrap not installed: apt-get install -y bubblewrap (make setup does this as root)")
    if request.node.get_closest_marker("docker"):
        request.getfixturevalue("docker_host")
    if request.node.get_closest_marker("gpu"):
        try:
            import torch
        except ImportError:
            pytest.skip("gpu test: torch not installed")
        if not torch.cuda.is_available():
            pytest.skip("gpu test: no CUDA device on this machine (runs on GPU machines)")
