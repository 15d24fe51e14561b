"""Fixtures of the proxy tests: a scripted upstream, a proxy in front of it, keys and capture readers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clawpipe import capture
from clawpipe.keys import mint_key
from clawpipe.proxy import ProxyServer
from tests.support.upstream import ScriptedUpstream

SECRET = b"test-secret"
ADMIN = "admin-token"


def key_for(rollout_id: str, run_id: str = "run1", iteration: int = 0) -> str:
    return mint_key(SECRET, run_id=run_id, iteration=iteration, rollout_id=rollout_id)


def read_captures(directory: Path) -> list[capture.CaptureRecord]:
    """Every record in every segment of the directory (sealed and open), in file order."""
    out: list[capture.CaptureRecord] = []
    for path in sorted(directory.glob("*.seg")) + sorted(directory.glob("*.open")):
        for rec in capture.read_segment(path):
            assert isinstance(rec, capture.CaptureRecord), f"damaged frame in {path}: {rec}"
            out.append(rec)
    return out


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    up = ScriptedUpstream().start()
    yield up
    up.stop()


class ProxyHandle:
    """A running proxy plus helpers."""

    def __init__(self, server: ProxyServer, capture_dir: Path) -> None:
        self.server = server
        self.capture_dir = capture_dir
        self.url = server.url

    def openai_base(self, rollout_id: str = "r1", **kw: Any) -> str:
        return f"{self.url}/r/{key_for(rollout_id, **kw)}/v1"

    def anthropic_base(self, rollout_id: str = "r1", **kw: Any) -> str:
        return f"{self.url}/r/{key_for(rollout_id, **kw)}"

    def records(self) -> list[capture.CaptureRecord]:
        return read_captures(self.capture_dir)


@pytest.fixture
def make_proxy(tmp_path: Path) -> Iterator[Any]:
    started: list[ProxyServer] = []

    def _make(upstreams: list[str], **kw: Any) -> ProxyHandle:
        cap = Path(kw.pop("capture_dir", tmp_path / f"captures{len(started)}"))
        server = ProxyServer(upstreams=upstreams, capture_dir=cap, secret=SECRET, admin_token=ADMIN, **kw)
        server.start()
        started.append(server)
        return ProxyHandle(server, cap)

    yield _make
    for s in started:
        s.stop(drain_timeout_s=5)


@pytest.fixture
def proxy(make_proxy: Any, upstream: ScriptedUpstream) -> ProxyHandle:
    return make_proxy([upstream.url])
