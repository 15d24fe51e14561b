"""What a rollout is to the runner: the spec it runs, the result row it writes, and how a process tree's
end becomes a rollout status, and how a verifier's reward and info are checked before they go into the row
(clawpipe/sandbox/runner.py runs them; clawpipe/sandbox/conclude.py fills in the row)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from clawpipe.sandbox.backends.base import Outcome
from clawpipe.sandbox.manifest import HarnessManifest
from clawpipe.sandbox.workdir import shown_name
from clawpipe.schemas import RolloutStatus


class TaskSetLike(Protocol):
    """What the runner needs of a task set (clawpipe.tasks.TaskSet satisfies it)."""

    name: str

    def prepare(self, task: dict[str, Any], workdir: Path) -> None: ...

    def verify(self, task: dict[str, Any], workdir: Path) -> tuple[float, dict[str, Any]]: ...


@dataclass(frozen=True, slots=True)
class RolloutSpec:
    """One rollout to run: which harness plays which task instance, and where its calls are attributed."""

    run_id: str
    iteration: int
    harness: str | HarnessManifest  # a name found under harnesses/, a folder path, or a loaded manifest
    task: dict[str, Any]  # a task instance (docs/ARCHITECTURE.md, contract C)
    model: str  # the served model name the harness is told to use
    group_id: str | None = None  # GRPO group; default: the task id
    sample_idx: int = 0
    rollout_id: str | None = None  # default: <group_id>.<sample_idx>, deterministic so a rerun overwrites
    policy_version: int | None = None
    eval: bool = False

    @property
    def group(self) -> str:
        return self.group_id or str(self.task.get("task_id", ""))

    @property
    def id(self) -> str:
        return self.rollout_id or f"{self.group}.{self.sample_idx}"


@dataclass(slots=True)
class RolloutResult:
    """A rollout's result row: the `rollouts` table's columns (schemas.ROLLOUTS), timestamps as ISO strings."""

    rollout_id: str
    run_id: str
    iteration: int
    group_id: str
    harness: str
    task_set: str
    task_id: str
    sample_idx: int
    backend: str
    status: str
    exit_code: int | None = None
    reward: float | None = None
    reward_info: str | None = None  # JSON
    n_calls: int = 0
    started_at: str | None = None
    ended_at: str | None = None
    duration_s: float = 0.0
    stderr_tail: str = ""
    error: str | None = None
    attempt: int = 1
    policy_version: int | None = None
    eval: bool = False
    workdir: str | None = field(default=None, metadata={"row": False})  # kept work dir, if any

    def to_row(self) -> dict[str, Any]:
        row = asdict(self)
        row.pop("workdir")
        return row

    @property
    def infra_failed(self) -> bool:
        return self.status == RolloutStatus.infra_error


ProgressFn = Callable[[RolloutResult, int, int], None]


def now_iso() -> str:
    return datetime.now(UTC).isoformat()


def classify(outcome: Outcome) -> RolloutStatus:
    """Turn how the process tree ended into a rollout status."""
    if outcome.timed_out:
        return RolloutStatus.timeout
    if outcome.oom and outcome.exit_code != 0:
        return RolloutStatus.oom
    if outcome.signal is not None:
        return RolloutStatus.crashed
    if outcome.exit_code == 0:
        return RolloutStatus.succeeded
    return RolloutStatus.failed


def masked_groups(results: Iterable[RolloutResult | Mapping[str, Any]]) -> set[tuple[str, int, str]]:
    """(run_id, iteration, group_id) of GRPO groups with a member that failed for infra reasons.

    Such a group is incomplete for reasons unrelated to the policy; its advantages would be biased, so
    training should skip it. Works on RolloutResult objects or result rows.
    """
    out: set[tuple[str, int, str]] = set()
    for r in results:
        row = r.to_row() if isinstance(r, RolloutResult) else r
        if row["status"] == RolloutStatus.infra_error:
            out.add((row["run_id"], int(row["iteration"]), row["group_id"]))
    return out


def checked_reward(reward: Any) -> float:
    """A verifier's reward as a float; ValueError naming it when it is not a finite number in [0, 1].

    A bool or a string is refused rather than converted: ``True`` or ``"1"`` would otherwise become 1.0.
    """
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise ValueError(f"reward {reward!r} is a {type(reward).__name__}, not a number in [0, 1]")
    value = float(reward)
    if not 0.0 <= value <= 1.0:  # NaN fails this too
        raise ValueError(f"reward {reward!r} outside [0, 1]")
    return value


def plain_info(value: Any) -> Any:
    """``value`` (reward info) with what plain UTF-8 JSON cannot hold made text: NaN and infinities become
    "nan"/"inf"/"-inf", lone surrogates (bytes of a file name that are not UTF-8) ``\\xNN``."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        return shown_name(value)
    if isinstance(value, dict):
        return {plain_info(k) if isinstance(k, str) else k: plain_info(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain_info(v) for v in value]
    return value
