"""Bookkeeping of the async loop (flows/async_loop.py): who may go on, what landed, how stale each call is.

The rollout producer and the trainer meet at the lake: the trainer takes iteration k once every group of
batch k has landed complete (``landed_batch``), and counts the calls it trains by age, the number of policy
versions between the policy that sampled a call and the policy being trained (``call_ages``). The producer
meets the trainer at ``Overlap``: it starts batch b only while b is at most ``lookahead`` batches ahead of
the steps published, so no call can be staler than the bound unless the bound is 0 (then the part of a
batch that was sampled before the last publish is dropped and counted).

A step's held-out evaluation runs beside the trainer's next step instead of before it: the next step
trains at once and only its publish waits until the evaluation's rollouts are done (``Overlap.evaluating``),
so every evaluation rollout runs on the policy it evaluates; steps are recorded in the run state in order.
Both sides note when each stage ran (``Overlap.span``), relative to the start of the loop.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from clawpipe.config import Settings
from clawpipe.errors import ClawpipeError, Halted
from clawpipe.pipeline.config import PipelineConfig
from clawpipe.pipeline.monitor import PeakMemory
from clawpipe.pipeline.state import RunState


def lookahead(cfg: PipelineConfig) -> int:
    """Batches the producer may run ahead of the trainer: max_staleness, and at least 1 (else there is no
    overlap; with max_staleness 0 the calls sampled before the last publish are dropped instead)."""
    return max(1, cfg.max_staleness)


def expected_groups(cfg: PipelineConfig) -> int:
    """Training groups in one batch: each harness's groups."""
    return sum(h.groups or cfg.groups for h in cfg.harnesses)


@dataclass
class Overlap:
    """What the producer and the trainer of one run share in the flow's process.

    ``state`` is the run state, advanced in order once a step is reported (resume starts from it);
    ``trained``, ``policy_version`` and ``policy_dir`` move as soon as a step has published, so neither the
    producer nor the next step waits for evaluation. ``stop`` is set when either side fails, so the other
    stops at its next wait instead of waiting forever. ``halted`` is set when the run itself stops (a
    cancel or a kill tears the event loop down): the work the two sides left in worker threads (a rollout
    batch, a training step, an evaluation) stops at its next check, raising :class:`Halted`. ``spans``
    holds (side, stage, iteration, start, end) in seconds since the loop started.
    """

    cfg: PipelineConfig
    state: RunState
    landed: set[int] = field(default_factory=set)  # batches the producer landed in this process
    producer_wait_s: dict[int, float] = field(default_factory=dict)
    stop: str | None = None
    halted: threading.Event = field(default_factory=threading.Event)
    trained: int = -1  # steps whose policy is published (the step's evaluation may still be running)
    policy_version: int = -1  # the policy published last: what new batches are rolled out against
    policy_dir: str = ""  # ... and its checkpoint, what the next step trains from
    spans: list[tuple[str, str, int, float, float]] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)
    # evaluations running: a count, not a flag, since a skipped step (nothing to publish) starts its own
    # evaluation while the previous one may still run, and the first to end must not free the next publish
    _evaluations: int = 0
    _evaluations_changed: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        if self.trained < 0:
            self.trained, self.policy_version = self.state.next_iteration, self.state.policy_version
            self.policy_dir = self.state.policy_dir

    def published(self, steps: int, policy_version: int, policy_dir: str | None = None) -> None:
        """A step's policy is live: later batches are rolled out against it and may start that much later,
        and the next step trains from it."""
        self.trained, self.policy_version = steps, policy_version
        self.policy_dir = policy_dir or self.policy_dir

    def position(self) -> dict[str, Any]:
        """Where the next step starts: the policy published last (its step may still be evaluating)."""
        return {**self.state.position(), "policy_dir": self.policy_dir, "policy_version": self.policy_version}

    def evaluating(self) -> None:
        """An evaluation of the live policy starts: no publish until it is ``evaluated``."""
        with self._evaluations_changed:
            self._evaluations += 1

    def evaluated(self) -> None:
        with self._evaluations_changed:
            self._evaluations -= 1
            self._evaluations_changed.notify_all()

    def wait_evaluated(self, poll_s: float = 0.5) -> float:
        """Block (a step about to publish) until no evaluation runs; the seconds waited. Raises when a side
        stopped meanwhile or before, so a step does not publish after an evaluation failed."""
        t0 = time.monotonic()
        with self._evaluations_changed:
            while self._evaluations > 0:
                self.check()
                self._evaluations_changed.wait(poll_s)
        self.check()
        return time.monotonic() - t0

    def span(self, side: str, stage: str, iteration: int, start: float) -> None:
        """Note that ``stage`` of ``iteration`` ran from monotonic ``start`` until now."""
        self.spans.append((side, stage, iteration, round(start - self.t0, 2), round(time.monotonic() - self.t0, 2)))

    def spans_of(self, iteration: int) -> dict[str, list[float]]:
        """The stages of one iteration, ``stage: [start, end]`` (the producer's as ``rollout``, ``land``)."""
        return {stage: [start, end] for _, stage, it, start, end in self.spans if it == iteration}

    def may_start(self, batch: int) -> bool:
        return batch - self.trained <= lookahead(self.cfg)

    def halt(self) -> None:
        """The run is stopping: no step publishes, no rollout starts (see ``halted``)."""
        self.stop = self.stop or "the run is stopping"
        self.halted.set()
        with self._evaluations_changed:
            self._evaluations_changed.notify_all()  # a step waiting to publish looks again at once

    def check(self) -> None:
        if self.halted.is_set():
            raise Halted("async loop stopped: the run is stopping")
        if self.stop:
            raise ClawpipeError(f"async loop stopped: {self.stop}")


# run_id -> what the two flows of its async loop share in this process (flows/async_loop.py), while it runs
RUNNING: dict[str, tuple[Overlap, PeakMemory]] = {}


def halt_event(run_id: str) -> threading.Event | None:
    """The ``halted`` event of run ``run_id``'s async loop in this process (None: no async loop runs it here)."""
    loop = RUNNING.get(run_id)
    return loop[0].halted if loop is not None else None


def landed_batch(settings: Settings, cfg: PipelineConfig, run_id: str, iteration: int) -> list[dict[str, Any]] | None:
    """The batch's rollout rows (latest attempt each) once every group has all its samples in the lake;
    None while some group is missing or short."""
    from clawpipe.sqlfiles import sql_text
    from clawpipe.tables import connect

    con = connect(settings.lake_dir, tables=("rollouts",), partition=(run_id, int(iteration)))
    params = {"run_id": run_id, "iteration": int(iteration)}
    try:
        groups = con.sql(sql_text("pipeline/landed_groups"), params=params).fetchall()
        if len(groups) < expected_groups(cfg) or any(n < cfg.samples for _, n in groups):
            return None
        return con.sql(sql_text("train/rollouts"), params=params).to_arrow_table().to_pylist()
    finally:
        con.close()


def call_ages(settings: Settings, run_id: str, iteration: int, policy_version: int) -> dict[int, int]:
    """Trainable calls of the iteration by age (policy versions behind ``policy_version``)."""
    from clawpipe.sqlfiles import sql_text
    from clawpipe.tables import connect

    con = connect(settings.lake_dir, tables=("model_calls", "rollouts"), partition=(run_id, int(iteration)))
    try:
        rows = con.sql(
            sql_text("pipeline/call_ages"), params={"run_id": run_id, "iteration": int(iteration)}
        ).fetchall()
    finally:
        con.close()
    ages: dict[int, int] = {}
    for version, n in rows:
        age = policy_version - int(version or 0)
        ages[age] = ages.get(age, 0) + int(n)
    return ages


def staleness(ages: dict[int, int], max_staleness: int) -> dict[str, Any]:
    """The step's staleness record: calls per age (every age from 0 to the oldest, zeros included, so the
    MLflow histogram has no holes), calls kept and dropped, the oldest kept age and the mean kept age."""
    kept = {a: n for a, n in ages.items() if a <= max_staleness}
    n_kept = sum(kept.values())
    oldest = max(ages, default=0)
    return {
        "ages": {str(a): ages.get(a, 0) for a in range(min(0, min(ages, default=0)), oldest + 1)},
        "trained_calls": n_kept,
        "dropped_calls": sum(n for a, n in ages.items() if a > max_staleness),
        "max_age": max((a for a, n in kept.items() if n), default=0),
        "mean_age": sum(a * n for a, n in kept.items()) / n_kept if n_kept else 0.0,
    }


def take_batch(overlap: Overlap, settings: Settings, run_id: str, iteration: int) -> list[dict[str, Any]] | None:
    """Batch ``iteration``'s rollout rows once the producer has landed it and the lake holds every group
    complete; None while it has not landed. Raises when either side stopped, or when the batch landed with a
    group missing or short (training it would bias the group baselines)."""
    overlap.check()
    if iteration not in overlap.landed:
        return None
    rows = landed_batch(settings, overlap.cfg, run_id, iteration)
    if rows is None:
        raise ClawpipeError(
            f"batch {iteration} of run {run_id} landed with fewer than {expected_groups(overlap.cfg)} complete "
            f"groups of {overlap.cfg.samples} rollouts: see `clawpipe sql` on rollouts where iteration = {iteration}"
        )
    return rows
