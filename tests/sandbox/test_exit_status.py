"""Whose failure a rollout's end was: the sandbox's (infra_error, retried) or the harness's (scored).

bwrap exits 1 both when the harness did and when the sandbox could not be built; what the harness wrote to
its stderr must not decide which, or code in the sandbox could turn its wrong answer into an infra error
and have its GRPO group masked out of training.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from clawpipe.sandbox import RolloutSpec, load_manifest, run_rollouts
from clawpipe.sandbox.backends.bwrap import command_exited
from clawpipe.sandbox.manifest import HarnessManifest
from clawpipe.sandbox.rollout import RolloutResult, masked_groups
from tests.sandbox.support import EchoTaskSet, Upstream, make_harness

POSING_AS_BWRAP = """
import os, sys
open(os.path.join(os.environ["CLAWPIPE_OUTPUT"], "answer.txt"), "w").write("41")
sys.stderr.write("bwrap: Can't mount proc on /newroot/proc: Device or resource busy\\n")
sys.exit(1)
"""


def run(tmp_path: Path, upstream: Upstream, echo: EchoTaskSet, manifest: HarnessManifest) -> list[RolloutResult]:
    return run_rollouts(
        [RolloutSpec(run_id="st", iteration=0, harness=manifest, task=echo.generate(1)[0], model="m", group_id="g")],
        proxy_url=upstream.url,
        backend="bwrap",
        results_path=tmp_path / "results.jsonl",
        secret=b"s",
        scratch_dir=tmp_path / "scratch",
        task_sets={"echo": echo},
        max_attempts=2,
    )


@pytest.mark.sandbox
def test_a_harness_posing_as_bwrap_is_scored_as_the_failure_it_is(
    tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    res = run(tmp_path, upstream, echo, load_manifest(make_harness(tmp_path / "h", "poser", POSING_AS_BWRAP)))
    assert (res[0].status, res[0].exit_code, res[0].reward, res[0].attempt) == ("failed", 1, 0.0, 1), res[0].error
    assert masked_groups(res) == set()


@pytest.mark.sandbox
def test_a_sandbox_that_could_not_be_built_is_still_an_infra_error(
    tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    # inline code: the runner's check that the command can start has no script file to miss
    harness = make_harness(tmp_path / "h", "gone", "", command=["python3", "-c", "print('never runs')"])
    manifest = load_manifest(harness)
    shutil.rmtree(harness)  # bwrap cannot bind the harness folder any more
    res = run(tmp_path, upstream, echo, manifest)
    assert (res[0].status, res[0].attempt, res[0].reward) == ("infra_error", 2, None), res[0].error
    assert "bwrap: Can't find source path" in res[0].stderr_tail, res[0].error
    assert masked_groups(res) == {("st", 0, "g")}


def test_only_an_exit_code_document_says_the_command_ran() -> None:
    for rest, written, ran in [
        (b"", b'{ "exit-code": 1 }\n', True),
        (b'\n{ "exit-code": 1 }', b"", True),
        (b"", b"", False),  # bwrap stopped before the command: its own failure
    ]:
        r, w = os.pipe()
        os.write(w, written)
        os.close(w)
        try:
            assert command_exited(r, rest) is ran
        finally:
            os.close(r)
