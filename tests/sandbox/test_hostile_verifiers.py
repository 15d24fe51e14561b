"""Verifiers that never return: a custom task set's host-side verifier runs under a time limit
(CLAWPIPE_VERIFY_TIMEOUT_S, or run_rollouts' verify_timeout_s); past it that rollout is an infra error naming
the limit and the setting, the other rollouts of the batch are scored, and the batch returns."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clawpipe.config import get_settings
from clawpipe.errors import ConfigError, VerifierTimeoutError
from clawpipe.sandbox import RolloutSpec, load_manifest, run_rollouts
from clawpipe.sandbox.backends import get_backend
from clawpipe.sandbox.verify import verify_rollout
from clawpipe.tasks.check import CheckRun
from clawpipe.tasks.fixit import FixitTaskSet
from tests.sandbox.support import EchoTaskSet, Upstream, make_harness

ANSWER = """
import os, pathlib
pathlib.Path(os.environ["CLAWPIPE_OUTPUT"], "answer.txt").write_text("42")
"""
LIMIT_S = 1.5
release = threading.Event()  # set at the end of each test: the hung verifiers' threads then return


class Stuck(EchoTaskSet):
    """The echo task set, except for tasks whose data.kind is "hang" (never returns) or "raise"."""

    name = "stuck"
    started = 0

    def verify(self, task: dict[str, Any], workdir: Path) -> tuple[float, dict[str, Any]]:
        kind = task["data"].get("kind")
        if kind == "hang":
            Stuck.started += 1
            release.wait()  # "forever": longer than any limit in these tests
            return 1.0, {"late": True}
        if kind == "raise":
            raise RuntimeError("the verifier broke")
        return super().verify(task, workdir)


@pytest.fixture(autouse=True)
def _release_hung_verifiers() -> Iterator[None]:
    release.clear()
    Stuck.started = 0
    yield
    release.set()


def tasks(*kinds: str) -> list[dict[str, Any]]:
    return [
        {
            "task_set": "stuck",
            "task_id": f"t{i}-{k}",
            "prompt": "p",
            "data": {"answer": "42", "kind": k},
            "max_turns": 1,
        }
        for i, k in enumerate(kinds)
    ]


def run(backend: str, kinds: tuple[str, ...], tmp_path: Path, upstream: Upstream, **options: Any) -> list[Any]:
    manifest = load_manifest(make_harness(tmp_path, "answer", ANSWER, task_sets=["stuck"]))
    specs = [RolloutSpec(run_id="r", iteration=0, harness=manifest, task=t, model="tiny") for t in tasks(*kinds)]
    return run_rollouts(
        specs,
        proxy_url=upstream.url,
        backend=backend,
        results_path=tmp_path / "results.jsonl",
        scratch_dir=tmp_path / "scratch",
        task_sets={"stuck": Stuck()},
        max_attempts=1,
        **options,
    )


@pytest.mark.sandbox
@pytest.mark.slow
def test_a_hung_verifier_ends_its_rollout_alone(tmp_path: Path, upstream: Upstream) -> None:
    kinds = ("hang", "ok", "raise", "hang", "ok")
    t0 = time.monotonic()
    # One rollout at a time: a hung verifier that kept its slot would stop every rollout after it.
    results = run("bwrap", kinds, tmp_path, upstream, concurrency=1, verify_timeout_s=LIMIT_S)
    took = time.monotonic() - t0
    assert Stuck.started == 2
    assert took < 2 * LIMIT_S + 60, took  # the batch returned: two limits plus five short sandboxes
    by_kind = list(zip(kinds, results, strict=True))
    for kind, r in by_kind:
        if kind == "ok":
            assert (r.status, r.reward) == ("succeeded", 1.0), (r.status, r.error, r.stderr_tail)
        elif kind == "hang":
            assert r.status == "infra_error" and r.reward is None
            assert "did not return within 1.5 s" in r.error and "CLAWPIPE_VERIFY_TIMEOUT_S" in r.error, r.error
            assert "'stuck'" in r.error and "verify_timeout_s" in r.error
            assert LIMIT_S <= r.duration_s < LIMIT_S + 30
        else:
            assert r.status == "infra_error" and "RuntimeError: the verifier broke" in r.error, r.error
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted(row["task_id"] for row in rows) == sorted(f"t{i}-{k}" for i, k in enumerate(kinds))  # each once


@pytest.mark.slow
def test_the_limit_defaults_to_the_setting(tmp_path: Path, upstream: Upstream, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAWPIPE_VERIFY_TIMEOUT_S", "0.5")
    get_settings.cache_clear()
    try:
        results = run("process", ("hang", "ok"), tmp_path, upstream)
    finally:
        get_settings.cache_clear()
    assert [r.status for r in results] == ["infra_error", "succeeded"]
    assert "within 0.5 s (CLAWPIPE_VERIFY_TIMEOUT_S" in results[0].error, results[0].error
    monkeypatch.delenv("CLAWPIPE_VERIFY_TIMEOUT_S")
    get_settings.cache_clear()
    assert get_settings().verify_timeout_s == 60.0  # the documented default


def test_a_limit_that_is_not_positive_is_refused(tmp_path: Path, upstream: Upstream) -> None:
    with pytest.raises(ConfigError, match="verify_timeout_s must be > 0"):
        run("process", ("ok",), tmp_path, upstream, verify_timeout_s=0)


class StuckScore(FixitTaskSet):
    """fixit, except that scoring the sandboxed check's result on the host never returns."""

    def score(self, task: dict[str, Any], run: CheckRun) -> tuple[float, dict[str, Any]]:
        release.wait()
        return super().score(task, run)


@pytest.mark.sandbox
def test_a_sandboxed_checks_host_side_score_is_limited_too(tmp_path: Path) -> None:
    stuck = StuckScore()
    task = stuck.generate(1, seed=0)[0]
    stuck.prepare(task, tmp_path)
    backend = get_backend("bwrap")
    try:
        t0 = time.monotonic()
        with pytest.raises(VerifierTimeoutError, match=r"'fixit' \(score\) did not return within 0.5 s"):
            verify_rollout(stuck, task, tmp_path, backend, timeout_s=0.5)
        # the check itself ran in its sandbox, outside the limit; only the hung score was cut short
        assert time.monotonic() - t0 < 30
        assert verify_rollout(FixitTaskSet(), task, tmp_path, backend, timeout_s=30)[0] == 0.0  # the bug is unfixed
    finally:
        backend.close()
