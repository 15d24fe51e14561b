"""Rollouts fanned out across worker hosts: a batch split into shards, each run where a worker takes it.

With ``rollout_pool`` set, the rollout stage splits a batch's specs into shards of ``shard_size``
(:func:`split`) and submits each as one flow run of the ``rollout-shard`` deployment on that pool
(flows/rollout_shard.py does the Prefect side; this module never imports Prefect). On the worker host,
:func:`run_shard` runs the shard's rollouts through the host's own capture proxy, has the proxy seal and
upload its captures, and only then uploads the shard's result rows to the run's capture prefix in the
lake. A row in the store therefore always has its calls in the store, and a shard killed before its end
leaves no row at all: its partial calls land, but training leaves out calls whose rollout has no result
row, so they never mix into a trained sequence.

The pipeline (clawpipe/pipeline/fanout.py) watches each shard through its flow run and its heartbeat in
the lake; every rollout of a shard that ended without its row runs again in a new shard, on any worker,
as ``<id>.a<N>`` in the same GRPO group (:func:`attempt_id`, the rule the in-process stage uses for
retries), where N counts the batch's attempts on disk, so an id is never reused. A shard given up is
fenced, and a shard that was only slow cannot add rows after its rollouts were rerun: before uploading
its rows a shard claims its decision object (``<key>.decision``) with a conditional create, and the
pipeline gives a shard up by claiming the same object, so the store lets exactly one of them decide
(:func:`decide`). A shard the pipeline wanted to give up but that had claimed first is publishing: the
pipeline waits for its rows instead of rerunning it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from clawpipe import objstore
from clawpipe.config import Settings
from clawpipe.errors import ConfigError, SandboxError

log = logging.getLogger(__name__)

SHARDS_DIR = "_shards"  # under the lake root: heartbeats and decisions of shards
PUBLISHED = "published"  # a shard's decision: its rows go to the store
GIVEN_UP = "given up"  # the pipeline's: its rollouts run again elsewhere


# --- splitting ------------------------------------------------------------------------


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


def lake_uri_of(settings: Settings) -> str:
    """The object-store lake a fanned-out run needs (every host reads and writes it)."""
    lake = settings.lake_uri or ""
    if not objstore.is_remote(lake):
        raise ConfigError(
            "rollout_pool needs the lake on an object store shared by every host: set CLAWPIPE_LAKE_URI to an "
            f"s3:// (or other fsspec) URL on the pipeline's host and every worker host (now {lake or 'unset'!r})"
        )
    return lake.rstrip("/")


def shard_state_path(lake_uri: str, req: ShardRequest, suffix: str) -> str:
    """``<lake>/_shards/<run>/<iteration>/<key><suffix>``: the shard's heartbeat (.json) or decision (.decision)."""
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


def run_shard(
    req: ShardRequest,
    settings: Settings,
    *,
    concurrency: int,
    hold: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> dict[str, Any]:
    """Run one shard on this host (called by the rollout-shard flow); returns the stage's summary.

    The heartbeat starts first, so a shard waiting in ``hold()`` (the host's sandbox slots) shows alive.

    Rollouts go through this host's capture proxy (started on first use). When they are done, the proxy
    seals and uploads its captures; then the shard's result rows are uploaded, unless the pipeline gave
    this attempt up meanwhile (:func:`decide`). Raises on any failure, leaving no rows, so the pipeline
    reruns the shard.
    """
    from clawpipe.pipeline.config import PipelineConfig
    from clawpipe.pipeline.stages import sample_specs, summarize_results

    lake = lake_uri_of(settings)
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
        with hold():
            results = _run_and_flush(req, settings, cfg, specs, concurrency, beat)
        if decide(lake, req, PUBLISHED) != PUBLISHED:
            raise SandboxError(f"shard {req.key} was given up by the pipeline (fenced); its rows are not published")
        local = _local_results(settings, req)
        fs, path = objstore.filesystem(results_url(lake, host, req))
        fs.pipe_file(path, local.read_bytes())  # rows last: their calls are in the store already
    except BaseException:
        beat.stop(state="failed")
        raise
    beat.stop(state="done")
    rows = [r.to_row() for r in results]
    log.info("shard %s on %s: %d rollouts, rows uploaded", req.key, host, len(rows))
    return summarize_results(rows)


def _local_results(settings: Settings, req: ShardRequest) -> Path:
    """The shard's rows on this host: outside the captures folder, so only the shard itself uploads them."""
    return settings.root / "shards" / req.run_id / str(req.iteration) / f"results-{req.key}.jsonl"


def _run_and_flush(
    req: ShardRequest, settings: Settings, cfg: Any, specs: list[Any], concurrency: int, beat: Heartbeat
) -> list[Any]:
    """The shard's rollouts through the host's proxy, then that proxy's captures sealed and in the store."""
    from clawpipe.pipeline.services import host_proxy, set_policy_version
    from clawpipe.proxy.upload import request_flush
    from clawpipe.sandbox.runner import run_rollouts

    admin = settings.admin()
    proxy_url = host_proxy(settings.root, req.upstreams, admin)
    set_policy_version(proxy_url, admin, req.policy_version)
    local = _local_results(settings, req)
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
    return results


def decide(lake_uri: str, req: ShardRequest, outcome: str) -> str:
    """Decide the shard's fate once: ``outcome`` if this call created its decision object (a conditional
    create, so of the shard publishing and the pipeline giving up exactly one wins), else the outcome
    already there."""
    fs, path = objstore.filesystem(shard_state_path(lake_uri, req, ".decision"))
    if objstore.create_exclusive(fs, path, outcome.encode()):
        return outcome
    return str(fs.cat_file(path).decode())
