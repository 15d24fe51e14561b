"""Rollout retries live in one layer: the batch's caller. The runner tries each rollout once; a batch with
infra errors raises (results written) until its last attempt, and the retry reruns only those rollouts."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from clawpipe.capture import read_results
from clawpipe.config import get_settings
from clawpipe.errors import SandboxError
from clawpipe.pipeline.config import load_config
from clawpipe.pipeline.stages import run_rollouts, sample_specs

pytestmark = [pytest.mark.sandbox]


def _proxy_that_dies() -> str:
    """A listener that answers the runner's start-up check, then goes away: every sandbox's calls fail."""
    listener = socket.create_server(("127.0.0.1", 0))

    def accept_once() -> None:
        conn, _ = listener.accept()
        conn.close()
        listener.close()

    threading.Thread(target=accept_once, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.slow
def test_infra_errors_raise_until_the_last_attempt_and_retries_rerun_only_them(home: Path) -> None:
    cfg = load_config(groups=1, samples=2, backend="bwrap", rollout_timeout_s=20)
    cfg = cfg.model_copy(update={"harnesses": cfg.harnesses[:1]})
    specs = sample_specs(cfg, "run-retry", 0, policy_version=0)
    settings = get_settings()
    kwargs = {"settings": settings, "batch_id": "rollout-0"}
    with pytest.raises(SandboxError, match="infra errors"):
        run_rollouts(cfg, specs, proxy_url=_proxy_that_dies(), final_attempt=False, **kwargs)
    summary = run_rollouts(cfg, specs, proxy_url=_proxy_that_dies(), final_attempt=True, **kwargs)
    assert summary["statuses"] == {"infra_error": 2}
    results = settings.captures_dir / "results" / "run-retry" / "0" / "results-rollout-0.jsonl"
    ids = [row["rollout_id"] for _, row, _ in read_results(results) if row]
    # one try per rollout per batch attempt (no hidden runner retries); the second attempt ran new ids
    assert sorted(ids) == sorted([s.id for s in specs] + [f"{s.id}.a2" for s in specs])
