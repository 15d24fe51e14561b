"""The pipeline's side of a fanned-out rollout batch: submit shards, watch them, rerun what they left undone.

:class:`FanOut` splits the batch (clawpipe/pipeline/shards.py), submits each shard to a
:class:`ShardRunner` (flows/rollout_shard.py: flow runs of the rollout-shard deployment) and polls it:

- ended (completed, failed, crashed, cancelled): done;
- taken by a worker but without a heartbeat for ``shard_start_s`` (the worker died while starting it:
  the flow run stays PENDING), or running with a heartbeat unchanged for ``shard_stall_s`` (its worker
  was killed, so nobody reports the end): given up;
- not finished ``shard_timeout_s`` after submission: given up.

A shard given up is fenced (its decision object claimed as given up, :func:`shards.decide`; the shard
claims it as published before uploading its rows, and the store lets one of them win) and marked
crashed; one that had claimed first is publishing, and its rows are awaited for one more
``shard_stall_s``. The rollouts of an ended shard that have no result row in the store run again in a new shard as
``<id>.a<N>`` (N: the batch's attempt counter on disk), at most ``max_attempts`` times each.

A watch that ends early (the run cancelled or killed: the signal in the main thread, or ``halt`` set by an
async run's loop; or an error of the watch itself, which the task's retry follows) first fences each shard
it is watching as given up, then cancels it on its worker: no shard goes on with rollouts that the retry or
``--resume`` reruns under new ids, and none publishes rows beside theirs. A shard that had already claimed
its rows is left to upload them, and awaited until ``CANCEL_S`` into the pass. Fencing needs only the
store, cancelling the API: every shard is fenced before any is cancelled, no cancel starts after
``CANCEL_S``, and each step stops at its first error (the store or the API away): a shard it could not
fence may still publish; one it fenced but could not cancel runs to its end without publishing. A shard
whose submission failed is fenced too (its flow run may have been created before the answer was lost).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from clawpipe import objstore
from clawpipe.config import Settings
from clawpipe.errors import Halted, SandboxError
from clawpipe.pipeline.attempts import AttemptCounter, attempt_id, attempt_ids, plan
from clawpipe.pipeline.shards import (
    GIVEN_UP,
    PUBLISHED,
    ShardRequest,
    decide,
    lake_uri_of,
    shard_state_path,
    split,
)

log = logging.getLogger(__name__)

FINAL = ("completed", "failed", "cancelled")
CANCEL_S = 10.0  # no shard cancel is started later than this into the pass: a stopping run is not held up
TAKEN = ("starting", "running")  # a worker has the shard: its heartbeat is expected


class ShardRunner(Protocol):
    """Where shards run (flows/rollout_shard.py: flow runs of a deployment on a work pool)."""

    def submit(self, req: ShardRequest) -> str: ...

    def state(self, handle: str) -> str: ...  # pending | starting | running | completed | failed | cancelled

    def give_up(self, handle: str, reason: str) -> None: ...

    # stop it wherever it is (its run is stopping); False: it had ended, nothing to stop
    def cancel(self, handle: str, reason: str) -> bool: ...


def read_batch_rows(lake_uri: str, run_id: str, iteration: int, batch_id: str) -> dict[str, dict[str, Any]]:
    """Result rows of every shard of a batch in the store, by rollout id (a final row wins over an infra error)."""
    fs, root = objstore.filesystem(objstore.captures_url(lake_uri))
    rows: dict[str, dict[str, Any]] = {}
    for path in sorted(fs.glob(f"{root}/results/*/{run_id}/{iteration}/results-{batch_id}.s*.jsonl")):
        for line in fs.cat_file(path).splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            rid = str(row["rollout_id"])
            if rid not in rows or rows[rid].get("status") == "infra_error":
                rows[rid] = row
    return rows


@dataclasses.dataclass
class _Live:
    req: ShardRequest
    submitted: float
    beat: str = ""
    changed: float = 0.0
    publishing: float = 0.0  # when the pipeline found the shard had claimed its rows (0: not found so)


@dataclasses.dataclass
class FanOut:
    """One batch fanned out over a runner; :meth:`run` returns the stage's summary."""

    cfg: Any  # PipelineConfig
    specs: list[Any]
    runner: ShardRunner
    lake_uri: str
    batch_id: str
    upstreams: list[str]
    counter: AttemptCounter
    max_attempts: int = 3
    poll_s: float = 2.0
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    halt: threading.Event | None = None  # set when an async run stops (clawpipe/pipeline/overlap.py)
    log: Any = log  # a flow passes its run logger, so the run's console and the UI show the shards
    submitted: list[ShardRequest] = dataclasses.field(default_factory=list)
    given_up: list[str] = dataclasses.field(default_factory=list)

    def run(self) -> dict[str, Any]:
        from clawpipe.pipeline.stages import summarize_results

        if not self.specs:
            return summarize_results([])
        first = self.specs[0]
        self.run_id, self.iteration = first.run_id, first.iteration
        self.policy_version, self.evaluation = first.policy_version or 0, bool(first.eval)
        ids = [s.id for s in self.specs]
        attempt = self.counter.next()
        kept, todo = plan(ids, self._final_rows(), attempt)
        self.current = {sid: attempt_ids(sid, attempt)[-1] for sid in ids}
        self.tries = dict.fromkeys(ids, 0)
        if kept:
            self.log.info("batch %s: %d rollouts already have rows, %d to run", self.batch_id, len(kept), len(todo))
        live: dict[str, _Live] = {}
        try:
            self._submit(todo, attempt, live)
            while live:
                self.sleep(self.poll_s)
                self._check_halt(live)
                for handle in list(live):
                    if self._ended(handle, live[handle]):
                        req = live.pop(handle).req
                        self._rerun(req, live)
        except BaseException:
            # the run is stopping (a signal, Halted) or the watch failed (the retry reruns what has no rows):
            # either way no shard may go on to publish rows for rollouts run again elsewhere
            self._cancel(live)
            raise
        rows = self._final_rows(include_infra=True)
        missing = [sid for sid in ids if self.current[sid] not in rows and sid not in kept]
        if missing:
            raise SandboxError(
                f"batch {self.batch_id}: {len(missing)} rollouts have no result after {self.max_attempts} attempts "
                f"(first: {missing[0]}; shards given up: {self.given_up[:3]}); see the rollout-shard flow runs"
            )
        chosen = [kept[sid] if sid in kept else rows[self.current[sid]] for sid in ids]
        return summarize_results(chosen)

    def _final_rows(self, include_infra: bool = False) -> dict[str, dict[str, Any]]:
        rows = read_batch_rows(self.lake_uri, self.run_id, self.iteration, self.batch_id)
        return {k: v for k, v in rows.items() if include_infra or v.get("status") != "infra_error"}

    def _check_halt(self, live: dict[str, _Live]) -> None:
        if self.halt is not None and self.halt.is_set():
            raise Halted(f"batch {self.batch_id}: the run is stopping; {len(live)} shards cancelled")

    def _submit(self, todo: list[tuple[str, str]], attempt: int, live: dict[str, _Live]) -> None:
        shard_count = len(self.submitted)
        for k, part in enumerate(split(todo, self.cfg.shard_size)):
            self._check_halt(live)  # a stopping run starts no more shards
            req = ShardRequest(
                cfg=self.cfg.model_dump(mode="json"),
                run_id=self.run_id,
                iteration=self.iteration,
                batch_id=self.batch_id,
                index=shard_count + k,
                attempt=attempt,
                policy_version=self.policy_version,
                evaluation=self.evaluation,
                rollout_ids=dict(part),
                upstreams=self.upstreams,
                heartbeat_s=max(1.0, self.cfg.shard_stall_s / 4),
            )
            for sid, rid in part:
                self.current[sid] = rid
                self.tries[sid] += 1
            try:
                handle = self.runner.submit(req)
            except BaseException:
                # its flow run may exist all the same (created before the answer was lost): it must not publish
                self._fence(req)
                raise
            self.submitted.append(req)
            live[handle] = _Live(req, submitted=self.clock())
            self.log.info("batch %s: shard %s (%d rollouts) submitted as %s", self.batch_id, req.key, len(part), handle)

    def _fence(self, req: ShardRequest) -> None:
        try:
            decide(self.lake_uri, req, GIVEN_UP)
        except Exception as exc:
            self.log.warning(
                "batch %s: could not fence shard %s, whose submission failed: %s", self.batch_id, req.key, exc
            )

    def _ended(self, handle: str, shard: _Live) -> bool:
        state = self.runner.state(handle)
        now = self.clock()
        if state in FINAL:
            if state != "completed":
                self.log.warning("batch %s: shard %s ended %s", self.batch_id, shard.req.key, state)
            return True
        if shard.publishing:
            if all(rid in self._final_rows(include_infra=True) for rid in shard.req.rollout_ids.values()):
                return True
            if now - shard.publishing <= self.cfg.shard_stall_s:
                return False
            # claimed, then silent for a whole stall period: it died between its claim and its one upload
            return self._give_up(handle, shard, "claimed its rows but never uploaded them")
        reason = ""
        if now - shard.submitted > self.cfg.shard_timeout_s:
            reason = f"not finished within shard_timeout_s={self.cfg.shard_timeout_s:.0f}"
        elif state in TAKEN:
            beat = self._heartbeat(shard.req)
            if not shard.changed:
                shard.changed = now  # first seen taken: the start allowance runs from here
            if beat != shard.beat:
                shard.beat, shard.changed = beat, now
            quiet = now - shard.changed
            if not shard.beat and quiet > self.cfg.shard_start_s:
                reason = f"taken, no heartbeat for {quiet:.0f}s (shard_start_s={self.cfg.shard_start_s:.0f})"
            elif shard.beat and quiet > self.cfg.shard_stall_s:
                reason = f"heartbeat stopped for {quiet:.0f}s (shard_stall_s={self.cfg.shard_stall_s:.0f})"
        if not reason:
            return False
        if decide(self.lake_uri, shard.req, GIVEN_UP) == PUBLISHED:
            shard.publishing = now
            self.log.info(
                "batch %s: shard %s claimed its rows before it could be given up: awaiting them",
                self.batch_id,
                shard.req.key,
            )
            return False
        return self._give_up(handle, shard, reason)

    def _give_up(self, handle: str, shard: _Live, reason: str) -> bool:
        self.runner.give_up(handle, f"shard {shard.req.key}: {reason}; its rollouts run again elsewhere")
        self.given_up.append(shard.req.key)
        self.log.warning("batch %s: shard %s given up: %s", self.batch_id, shard.req.key, reason)
        return True

    def _cancel(self, live: dict[str, _Live]) -> None:
        """The watch ends early: fence every live shard first (the store only), then cancel the fenced ones on
        their workers (the API), then give those that had claimed their rows the rest of ``CANCEL_S`` to upload
        them, so a rerun that follows finds them."""
        deadline = self.clock() + CANCEL_S
        fenced: list[tuple[str, _Live]] = []
        publishing: list[_Live] = []
        shards = list(live.items())
        for n, (handle, shard) in enumerate(shards):
            try:
                won = decide(self.lake_uri, shard.req, GIVEN_UP)
            except Exception as exc:  # the store away: these may still publish, and a rerun may add to them
                keys = ", ".join(s.req.key for _, s in shards[n:])
                self.log.warning("batch %s: could not fence shards %s (%s)", self.batch_id, keys, exc)
                break
            if won == PUBLISHED:
                self.log.info("batch %s: shard %s claimed its rows: left to upload them", self.batch_id, shard.req.key)
                publishing.append(shard)
            else:
                fenced.append((handle, shard))
        for n, (handle, shard) in enumerate(fenced):
            try:
                if self.clock() > deadline:
                    raise TimeoutError(f"no cancel is started after CANCEL_S={CANCEL_S:.0f}s")
                stopping = self.runner.cancel(handle, f"shard {shard.req.key}: its run is stopping")
            except Exception as exc:  # the run stops either way; a fenced shard cannot publish
                keys = ", ".join(s.req.key for _, s in fenced[n:])
                self.log.warning(
                    "batch %s: could not cancel shards %s (%s): they run to their end on their workers, "
                    "without publishing",
                    self.batch_id,
                    keys,
                    exc,
                )
                break
            self.log.info(
                "batch %s: shard %s %s", self.batch_id, shard.req.key, "cancelled" if stopping else "had ended"
            )
        self._await_rows(publishing, deadline)

    def _await_rows(self, publishing: list[_Live], deadline: float) -> None:
        waiting = list(publishing)
        while waiting:
            try:
                rows = self._final_rows(include_infra=True)
            except Exception as exc:
                self.log.warning("batch %s: cannot read the shards' rows (%s)", self.batch_id, exc)
                return
            waiting = [s for s in waiting if not all(r in rows for r in s.req.rollout_ids.values())]
            if not waiting:
                return
            if self.clock() > deadline:
                self.log.warning(
                    "batch %s: shards %s claimed their rows but have not uploaded them within CANCEL_S=%.0fs",
                    self.batch_id,
                    ", ".join(s.req.key for s in waiting),
                    CANCEL_S,
                )
                return
            self.sleep(min(self.poll_s, 0.5))

    def _heartbeat(self, req: ShardRequest) -> str:
        fs, path = objstore.filesystem(shard_state_path(self.lake_uri, req, ".json"))
        try:
            return str(fs.cat_file(path).decode())
        except FileNotFoundError:
            return ""

    def _rerun(self, req: ShardRequest, live: dict[str, _Live]) -> None:
        rows = self._final_rows()
        todo = [sid for sid, rid in req.rollout_ids.items() if rid not in rows]
        retry = [sid for sid in todo if self.tries[sid] < self.max_attempts]
        if not todo:
            return
        self.log.warning(
            "batch %s: shard %s ended with %d of %d rollouts unfinished; rerunning %d under new ids",
            self.batch_id,
            req.key,
            len(todo),
            len(req.rollout_ids),
            len(retry),
        )
        if retry:
            attempt = self.counter.next()
            self._submit([(sid, attempt_id(sid, attempt)) for sid in retry], attempt, live)


def fan_out(
    cfg: Any,
    specs: list[Any],
    *,
    runner: ShardRunner,
    settings: Settings,
    batch_id: str,
    upstreams: list[str],
    halt: threading.Event | None = None,
    logger: Any = log,
) -> dict[str, Any]:
    """Run a batch's specs as shards on ``runner``; returns the stage's summary (see :class:`FanOut`)."""
    if not specs:
        from clawpipe.pipeline.stages import summarize_results

        return summarize_results([])
    counter = AttemptCounter(settings.runs_dir / specs[0].run_id / "shards" / f"{batch_id}.attempt")
    return FanOut(cfg, specs, runner, lake_uri_of(settings), batch_id, upstreams, counter, halt=halt, log=logger).run()


def land_run(settings: Settings) -> dict[str, Any]:
    """Land what is new. With an object-store lake the captures are read from its capture prefix, where every
    host's proxy uploads (this host's own proxy is flushed first, so its open segment is there too)."""
    from clawpipe.lake import land
    from clawpipe.proxy.segments import upload_url_from_env
    from clawpipe.proxy.upload import request_flush

    lake = settings.lake_uri or ""
    if not objstore.is_remote(lake) or upload_url_from_env() is None:  # captures stay on this host's disk
        return land(settings.captures_dir, settings.lake_dir).as_dict()
    request_flush(settings.captures_dir)
    return land(objstore.captures_url(lake), lake).as_dict()
