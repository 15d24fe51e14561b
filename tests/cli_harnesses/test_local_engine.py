"""The real CLIs against clawpipe's local engine serving the tiny policy (CPU), in bwrap, via the proxy.

The tiny policy answers with garbage: what matters is that each CLI's real requests (Anthropic Messages
with a system role inside messages and beta fields; Responses with developer messages and namespace
tools; Chat Completions with tools and usage; OpenClaw's Chat Completions with max_completion_tokens on
Node 24) are served, that each CLI exits by itself, that every call
is captured with the engine's token ids, and that the calls land and the trees build. Minimal modes keep
the prompts at 4-13 KB so that the CPU prefill stays short.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clawpipe import capture
from tests.cli_harnesses.test_in_sandbox import ONE_API_CLIS, land_and_build_trees, run_batch

SECRET = b"cli-harness-test-secret"
VARIANTS = (*ONE_API_CLIS, "openclaw-chat")

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from clawpipe.serving.policy import init_policy
    from clawpipe.serving.server import start_server

    policy = init_policy(tmp_path_factory.mktemp("policy") / "tiny", size="tiny", seed=0)
    handle = start_server(policy, device="cpu", served_name="tiny", max_batch=8, max_tokens_cap=24)
    yield handle
    handle.stop()


def test_each_cli_against_the_local_engine(tmp_path: Path, engine: Any, cli_installed: None) -> None:
    from clawpipe.proxy import ProxyServer

    proxy = ProxyServer(
        upstreams=[engine.url], capture_dir=tmp_path / "captures", secret=SECRET, admin_token="admin", fsync=False
    )
    proxy.start()
    try:
        results = run_batch(proxy.url, tmp_path, mode="minimal", timeout_s=150, variants=VARIANTS)
    finally:
        proxy.stop()
    by_harness = dict(zip(VARIANTS, results, strict=True))
    for r in results:
        print(f"{r.harness}: status={r.status} exit={r.exit_code} calls={r.n_calls} seconds={r.duration_s}")
    for harness in VARIANTS:
        r = by_harness[harness]
        # Garbage answers may make a CLI report an error, but it must end by itself, not by the timeout.
        assert r.status in ("succeeded", "failed"), (harness, r.status, r.error, r.stderr_tail[-1500:])
        assert r.n_calls >= 1, harness
    records = []
    for path in sorted((tmp_path / "captures").glob("*.seg")) + sorted((tmp_path / "captures").glob("*.open")):
        records += [rec for rec in capture.read_segment(path) if isinstance(rec, capture.CaptureRecord)]
    apis = {rec.header["api"] for rec in records}
    assert {"messages", "responses", "chat"} <= apis
    for rec in records:
        h = rec.header
        assert h["http_status"] == 200 and h["status"] == "ok", (h["api"], h["http_status"], rec.response[:500])
        assert h["token_source"] == "upstream", h
        assert h["policy_version"] is not None
    # Claude Code's request, as it sent it, reached the engine (a system role inside messages, beta query).
    claude = [rec for rec in records if rec.header["api"] == "messages"]
    assert claude and claude[0].header["query"] in ("beta=true", {"beta": "true"})
    assert "thinking" in json.loads(claude[0].request)
    stats = land_and_build_trees(tmp_path / "captures", tmp_path / "lake", "clirun")
    for harness in VARIANTS:
        row = stats[by_harness[harness].rollout_id]
        assert row["n_calls"] == by_harness[harness].n_calls and row["n_leaves"] >= 1, row
