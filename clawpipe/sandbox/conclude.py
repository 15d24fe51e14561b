"""Concluding a rollout whose harness has exited: what its result row says about how it ended, and its reward.

:func:`conclude` turns the backend's :class:`Outcome` and what the harness left in its rollout folder into the
row's status, exit code, call count, error and stderr tail (a full disk quota, a flooded bridge and a
Python MemoryError each get a status of their own; a limit that ended or hindered the harness, time,
memory, processes or disk, is named in the error with the setting that raises it). :func:`score` then
scrubs the work dir and asks the task set's verifier for the reward under ``verify_timeout_s``
(clawpipe.sandbox.verify); a verifier that raises, runs too long or returns something that is not a reward
leaves the rollout an infra error. clawpipe/sandbox/runner.py calls both, in that order, for each rollout
that ran.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from clawpipe.errors import VerifierTimeoutError
from clawpipe.sandbox.backends.base import Backend, Outcome
from clawpipe.sandbox.limits import Limits
from clawpipe.sandbox.quota import INODES_PER_MB, MIN_INODES, out_of_inodes, over_quota, quota_inodes
from clawpipe.sandbox.rollout import RolloutResult, RolloutSpec, TaskSetLike, checked_reward, classify, plain_info
from clawpipe.sandbox.uids import UidPool
from clawpipe.sandbox.verify import verify_rollout
from clawpipe.sandbox.workdir import ends_with_memory_error, scrub_report, scrub_workdir, tail
from clawpipe.schemas import RolloutStatus

logger = logging.getLogger(__name__)


def quota_error(rdir: Path, disk_mb: int) -> str:
    """What the row says when the work dir and logs filled the rollout's disk quota, naming the limit hit."""
    if out_of_inodes(rdir):  # many empty files fill no bytes: say which limit it was
        return (
            f"work dir and logs reached the disk quota's limit of {quota_inodes(disk_mb)} files "
            f"([resources] disk_mb = {disk_mb}; {INODES_PER_MB} files per MB, at least {MIN_INODES})"
        )
    return f"work dir and logs reached the disk quota ([resources] disk_mb = {disk_mb})"


def limit_notes(status: RolloutStatus, outcome: Outcome, limits: Limits, timeout_s: float) -> list[str]:
    """What the row says of the limits the harness ran into: which one, its value, and where it is set."""
    notes = []
    if status == RolloutStatus.timeout:
        notes.append(
            f"the harness was still running at its time limit of {timeout_s:g} s and was killed with every process "
            "it started (timeout_s in harness.toml, or the rollout's --timeout)"
        )
    elif status == RolloutStatus.oom and outcome.oom:
        notes.append(
            f"the harness ran out of its memory limit of {limits.memory_mb} MB ([resources] memory_mb in "
            "harness.toml; files in its /tmp, /dev/shm and work dir count toward it)"
        )
    elif status == RolloutStatus.oom:  # no memory cgroup: the address-space rlimit stood in for it
        notes.append(
            f"Python raised MemoryError at the harness's address-space limit of {limits.memory_mb} MB "
            "([resources] memory_mb in harness.toml)"
        )
    if outcome.pids_limited:
        notes.append(
            f"a new process or thread was refused at the sandbox's limit of {limits.pids} "
            "([resources] pids in harness.toml)"
        )
    return notes


def conclude(result: RolloutResult, outcome: Outcome, rdir: Path, limits: Limits, timeout_s: float) -> None:
    """Fill in how the rollout ended from ``outcome`` and its folder ``rdir``, which ran under ``limits`` and
    ``timeout_s``."""
    result.status = classify(outcome)
    result.exit_code = outcome.exit_code
    result.n_calls = outcome.requests
    full = over_quota(rdir, limits.disk_mb, outcome.signal)
    if full:
        result.status = RolloutStatus.disk_quota  # its stderr may be cut short: the logs share the quota
    if outcome.refused:  # the sandbox flooded its own bridge: code in it (a policy's too) did that, so
        # the rollout is scored as a failure; as infra_error it would take its GRPO group out of training
        result.status = RolloutStatus.failed
    result.stderr_tail = tail(rdir / "stderr.log")
    if result.status == RolloutStatus.failed and ends_with_memory_error(result.stderr_tail):
        result.status = RolloutStatus.oom  # the rlimit fallback: Python raised MemoryError
    if full:
        result.error = quota_error(rdir, limits.disk_mb)
    else:
        result.error = "; ".join([*limit_notes(result.status, outcome, limits, timeout_s), *outcome.notes]) or None


def score(
    result: RolloutResult,
    spec: RolloutSpec,
    work: Path,
    *,
    task_set: Callable[[str], TaskSetLike],
    backend: Backend,
    uids: UidPool | None,
    timeout_s: float | None,
) -> None:
    """Reward from the task set (``task_set`` resolves its name) verifying ``work``; a verifier that raises,
    or runs past ``timeout_s``, makes an infra error (not retried): neither says anything about the policy."""
    removed = scrub_workdir(work)
    try:
        # Work-dir code runs only in a fresh sandbox of this backend, never here (clawpipe.sandbox.verify).
        reward, info = verify_rollout(
            task_set(spec.task["task_set"]), spec.task, work, backend, uids=uids, timeout_s=timeout_s
        )
        reward = checked_reward(reward)
        if removed:
            info = {**info, **scrub_report(removed)}
        result.reward = reward
        result.reward_info = json.dumps(plain_info(info), default=str, allow_nan=False)
    except VerifierTimeoutError as exc:
        logger.error("rollout=%s: %s", spec.id, exc)
        result.status = RolloutStatus.infra_error
        result.error = str(exc)
    except Exception as exc:
        logger.exception("rollout=%s verifier failed", spec.id)
        result.status = RolloutStatus.infra_error
        result.error = f"verifier of {spec.task['task_set']!r} raised {type(exc).__name__}: {exc}"
