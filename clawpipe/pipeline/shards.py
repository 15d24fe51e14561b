"""Rollouts fanned out across worker hosts: a batch split into shards, each run where a worker takes it.

With ``rollout_pool`` set, the rollout stage splits a batch's specs into shards of ``shard_size``
(:func:`split`) and submits each as one flow run of the ``rollout-shard`` deployment on that pool
(flows/rollout_shard.py does the Prefect side; this module never imports Prefect). On the worker host,
:func:`run_shard` runs the shard's rollouts through the host's own capture proxy, has the proxy seal and
upload its captures, and only then uploads the shard's result rows to the run's capture prefix in the
lake. A row in the store therefore always has its calls in the store, and a shard killed before its end
leaves no row at all: its partial calls land, but training leaves out calls whose rollout has no result
row, so they never mix into a trained sequence.

The pipeline (:func:`fan_out`) watches each shard: finished (its flow run ended), dead (its heartbeat in
the lake stopped for ``shard_stall_s``) or late (``shard_timeout_s``). Every rollout of a shard that ended
without its row is run again in a new shard, on any worker, as ``<id>.a<N>`` in the same GRPO group
(:func:`attempt_id`, the rule the in-process stage uses for retries), where N counts the batch's attempts
on disk, so an id is never reused. A shard given up is fenced (a marker in the lake it checks before
uploading its rows), so one that was only slow cannot add rows after its rollouts were rerun.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from clawpipe import objstore
from clawpipe.config import Settings
from clawpipe.errors import ConfigError, SandboxError

log = logging.getLogger(__name__)

SHARDS_DIR = "_shards"  # under the lake root: heartbeats and fences of shards
FINAL = ("completed", "failed")


# --- splitting and attempt ids ------------------------------------------------------------------------


def split(items: Sequence[Any], size: int) -> list[list[Any]]:
    """Consecutive shards of at most ``size`` items, as even as possible (10 by 4 -> 4, 3, 3).

    Specs come ordered by group, so a group stays on few hosts; a group may still span two shards, which
    is harmless (each rollout is independent; the group is joined again in the lake).
    """
    if size < 1:
        raise ConfigError(f"shard_size must be >= 1, got {size}")
    if not items:
        return []
    n = -(-len(items) // size)
    base, extra = divmod(len(items), n)
    out, start = [], 0
    for k in range(n):
        end = start + base + (1 if k < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out


def attempt_id(spec_id: str, attempt: int) -> str:
    """The rollout id of ``spec_id`` on attempt N of its batch: itself on the first, ``<id>.a<N>`` after."""
    return spec_id if attempt <= 1 else f"{spec_id}.a{attempt}"


def attempt_ids(spec_id: str, attempts: int) -> list[str]:
    """Every id ``spec_id`` may have run under in attempts 1..N, oldest first."""
    return [attempt_id(spec_id, a) for a in range(1, attempts + 1)]


def plan(
    spec_ids: Iterable[str], done: dict[str, dict[str, Any]], attempt: int
) -> tuple[dict[str, dict[str, Any]], list[tuple[str, str]]]:
    """What attempt ``attempt`` of a batch keeps and runs.

    ``done`` maps rollout ids to their final (non infra-error) result rows. A spec with a row under any of
    its earlier ids is kept (the latest such row); every other spec runs as ``attempt_id(id, attempt)``.
    Returns ({spec id: kept row}, [(spec id, id to run under)]).
    """
    kept: dict[str, dict[str, Any]] = {}
    todo: list[tuple[str, str]] = []
    for sid in spec_ids:
        finished = [done[i] for i in attempt_ids(sid, attempt) if i in done]
        if finished:
            kept[sid] = finished[-1]
        else:
            todo.append((sid, attempt_id(sid, attempt)))
    return kept, todo


class AttemptCounter:
    """A batch's attempt number, kept on disk so a retried task or a resumed run never reuses an id."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def current(self) -> int:
        return int(self.path.read_text()) if self.path.is_file() else 0

    def next(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        value = self.current + 1
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(str(value))
        os.replace(tmp, self.path)
        return value


# --- one shard ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardRequest:
    """Everything a worker host needs to run one shard (plain JSON: it travels as a flow-run parameter).

    The worker rebuilds the specs from the config (sampling is seeded), so only ids travel:
    ``rollout_ids`` maps each spec id to the id it runs under in this attempt.
    """

    cfg: dict[str, Any]
    run_id: str
    iteration: int
    batch_id: str
    index: int
    attempt: int
    policy_version: int
    evaluation: bool
    rollout_ids: dict[str, str]
    upstreams: list[str]
    heartbeat_s: float = 15.0

    @property
    def key(self) -> str:
        return f"{self.batch_id}.s{self.index}.a{self.attempt}"

    def to_params(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> ShardRequest:
        return cls(**params)


def _lake_uri(settings: Settings) -> str:
    lake = settings.lake_uri or ""
    if not objstore.is_remote(lake):
        raise ConfigError(
            "rollout_pool needs the lake on an object store shared by every host: set CLAWPIPE_LAKE_URI to an "
            f"s3:// (or other fsspec) URL on the pipeline's host and every worker host (now {lake or 'unset'!r})"
        )
    return lake.rstrip("/")


def shard_state_path(lake_uri: str, req: ShardRequest, suffix: str) -> str:
    """``<lake>/_shards/<run>/<iteration>/<key><suffix>``: the shard's heartbeat (.json) or fence (.fenced)."""
    return f"{lake_uri}/{SHARDS_DIR}/{req.run_id}/{req.iteration}/{req.key}{suffix}"


def results_url(lake_uri: str, host: str, req: ShardRequest) -> str:
    """Where a shard's result rows go: the host's results under the capture prefix, a name landing reads."""
    captures = objstore.captures_url(lake_uri)
    return f"{captures}/results/{host}/{req.run_id}/{req.iteration}/results-{req.key}.jsonl"


class Heartbeat:
    """Rewrites the shard's heartbeat object in the lake every ``interval_s`` and after each rollout."""

    def __init__(self, url: str, body: dict[str, Any], interval_s: float) -> None:
        self.fs, self.path = objstore.filesystem(url)
        self.body = {**body, "pid": os.getpid(), "done": 0, "beat": 0}
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shard-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def beat(self, **changes: Any) -> None:
        with self._lock:
            self.body.update(changes)
            self.body["beat"] += 1
            self.body["time"] = time.time()
            data = json.dumps(self.body).encode()
        try:
            self.fs.pipe_file(self.path, data)
        except OSError as exc:  # the pipeline sees a stall if this persists; one miss is harmless
            log.warning("shard heartbeat not written path=%s error=%s", self.path, exc)

    def progress(self, result: Any, done: int, total: int) -> None:
        self.beat(done=done, total=total)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def stop(self, **final: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.beat(**final)


def run_shard(req: ShardRequest, settings: Settings, *, concurrency: int) -> dict[str, Any]:
    """Run one shard on this host (called by the rollout-shard flow); returns the stage's summary.

    Rollouts go through this host's capture proxy (started on first use). When they are done, the proxy
    seals and uploads its captures; then the shard's result rows are uploaded, unless the pipeline fenced
    this attempt meanwhile. Raises on any failure, leaving no rows, so the pipeline reruns the shard.
    """
    from clawpipe.pipeline.config import PipelineConfig
    from clawpipe.pipeline.services import host_proxy, set_policy_version
    from clawpipe.pipeline.stages import sample_specs, summarize_results
    from clawpipe.proxy.upload import request_flush
    from clawpipe.sandbox.runner import run_rollouts

    lake = _lake_uri(settings)
    cfg = PipelineConfig.model_validate(req.cfg)
    host = objstore.host_id(settings.captures_dir)
    every = {
        s.id: s
        for s in sample_specs(
            cfg, req.run_id, req.iteration, policy_version=req.policy_version, evaluation=req.evaluation
        )
    }
    unknown = sorted(set(req.rollout_ids) - set(every))
    if unknown:
        raise ConfigError(f"shard {req.key}: rollouts {unknown[:3]} are not in the batch this config samples")
    specs = [dataclasses.replace(every[sid], rollout_id=rid) for sid, rid in req.rollout_ids.items()]
    beat = Heartbeat(shard_state_path(lake, req, ".json"), {"host": host, "total": len(specs)}, req.heartbeat_s)
    beat.start()
    try:
        admin = settings.admin()
        proxy_url = host_proxy(settings.root, req.upstreams, admin)
        set_policy_version(proxy_url, admin, req.policy_version)
        local = settings.root / "shards" / req.run_id / str(req.iteration) / f"results-{req.key}.jsonl"
        local.unlink(missing_ok=True)  # an attempt's ids are new: nothing earlier belongs in its file
        options: dict[str, Any] = {"timeout_s": cfg.rollout_timeout_s} if cfg.rollout_timeout_s else {}
        results = run_rollouts(
            specs,
            proxy_url=proxy_url,
            backend=cfg.backend,
            concurrency=concurrency,
            results_path=local,
            progress=beat.progress,
            max_attempts=1,
            batch_id=req.key,
            **options,
        )
        report = request_flush(settings.captures_dir)
        if report is None or not report.get("ok"):
            raise SandboxError(
                f"shard {req.key}: the host proxy's captures are not all in the store ({report}); "
                "its rows stay unpublished and the pipeline reruns the shard"
            )
        fs, _ = objstore.filesystem(lake)
        if fs.exists(objstore.filesystem(shard_state_path(lake, req, ".fenced"))[1]):
            raise SandboxError(f"shard {req.key} was given up by the pipeline (fenced); its rows are not published")
        fs_rows, path = objstore.filesystem(results_url(lake, host, req))
        fs_rows.pipe_file(path, local.read_bytes())
    except BaseException:
        beat.stop(state="failed")
        raise
    beat.stop(state="done")
    rows = [r.to_row() for r in results]
    log.info("shard %s on %s: %d rollouts, rows uploaded", req.key, host, len(rows))
    return summarize_results(rows)


# --- the pipeline's side ------------------------------------------------------------------------------


class ShardRunner(Protocol):
    """Where shards run (flows/rollout_shard.py: flow runs of a deployment on a work pool)."""

    def submit(self, req: ShardRequest) -> str: ...

    def state(self, handle: str) -> str: ...  # "pending" | "running" | "completed" | "failed"

    def give_up(self, handle: str, reason: str) -> None: ...


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
            log.info("batch %s: %d rollouts already have rows, %d to run", self.batch_id, len(kept), len(todo))
        live: dict[str, _Live] = {}
        self._submit(todo, attempt, live)
        while live:
            self.sleep(self.poll_s)
            for handle in list(live):
                if self._ended(handle, live[handle]):
                    req = live.pop(handle).req
                    self._rerun(req, live)
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

    def _submit(self, todo: list[tuple[str, str]], attempt: int, live: dict[str, _Live]) -> None:
        shard_count = len(self.submitted)
        for k, part in enumerate(split(todo, self.cfg.shard_size)):
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
            handle = self.runner.submit(req)
            self.submitted.append(req)
            live[handle] = _Live(req, submitted=self.clock())
            log.info("batch %s: shard %s (%d rollouts) submitted as %s", self.batch_id, req.key, len(part), handle)

    def _ended(self, handle: str, shard: _Live) -> bool:
        state = self.runner.state(handle)
        now = self.clock()
        if state in FINAL:
            if state == "failed":
                log.warning("batch %s: shard %s ended %s", self.batch_id, shard.req.key, state)
            return True
        reason = ""
        if now - shard.submitted > self.cfg.shard_timeout_s:
            reason = f"not finished within shard_timeout_s={self.cfg.shard_timeout_s:.0f}"
        elif state == "running":
            beat = self._heartbeat(shard.req)
            if beat != shard.beat or not shard.changed:
                shard.beat, shard.changed = beat, now
            elif now - shard.changed > self.cfg.shard_stall_s:
                reason = (
                    f"heartbeat stopped for {now - shard.changed:.0f}s (shard_stall_s={self.cfg.shard_stall_s:.0f})"
                )
        if not reason:
            return False
        self._fence(shard.req)
        self.runner.give_up(handle, f"shard {shard.req.key}: {reason}; its rollouts run again elsewhere")
        self.given_up.append(shard.req.key)
        log.warning("batch %s: shard %s given up: %s", self.batch_id, shard.req.key, reason)
        return True

    def _heartbeat(self, req: ShardRequest) -> str:
        fs, path = objstore.filesystem(shard_state_path(self.lake_uri, req, ".json"))
        try:
            return str(fs.cat_file(path).decode())
        except FileNotFoundError:
            return ""

    def _fence(self, req: ShardRequest) -> None:
        fs, path = objstore.filesystem(shard_state_path(self.lake_uri, req, ".fenced"))
        fs.pipe_file(path, b"given up")

    def _rerun(self, req: ShardRequest, live: dict[str, _Live]) -> None:
        rows = self._final_rows()
        todo = [sid for sid, rid in req.rollout_ids.items() if rid not in rows]
        retry = [sid for sid in todo if self.tries[sid] < self.max_attempts]
        if not todo:
            return
        log.warning(
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
    cfg: Any, specs: list[Any], *, runner: ShardRunner, settings: Settings, batch_id: str, upstreams: list[str]
) -> dict[str, Any]:
    """Run a batch's specs as shards on ``runner``; returns the stage's summary (see :class:`FanOut`)."""
    if not specs:
        from clawpipe.pipeline.stages import summarize_results

        return summarize_results([])
    counter = AttemptCounter(settings.runs_dir / specs[0].run_id / "shards" / f"{batch_id}.attempt")
    return FanOut(cfg, specs, runner, _lake_uri(settings), batch_id, upstreams, counter).run()


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
