"""The rollout runner: many harness executions at once, one durable result row per rollout.

:func:`run_rollouts` (or the streaming :func:`iter_rollouts`) takes :class:`RolloutSpec` s, prepares each
rollout's folder on the host (work dir, task JSON, the task set's starting files), mints its proxy key,
runs it in a backend with bounded concurrency, computes the reward with the task set's verifier after
the harness exits, and appends the row to the results JSONL (docs/ARCHITECTURE.md, contract D) the
moment it is known, so nothing is lost if the batch dies. Only infra errors (a sandbox that would not
start) are retried, up to ``max_attempts`` (the pipeline passes 1: its Prefect task retries the batch);
:func:`clawpipe.sandbox.rollout.masked_groups` names GRPO groups that an infra failure left incomplete.
What is checked before the batch starts lives in clawpipe/sandbox/precheck.py; how a rollout whose harness
exited gets its status and reward, in clawpipe/sandbox/conclude.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from clawpipe.capture import append_result
from clawpipe.errors import ConfigError, Halted, SandboxError
from clawpipe.keys import mint_key
from clawpipe.sandbox.backends import get_backend
from clawpipe.sandbox.backends.base import Backend, Outcome, SandboxJob, takes_own_uids
from clawpipe.sandbox.bridge import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, Bridge
from clawpipe.sandbox.conclude import conclude, score
from clawpipe.sandbox.limits import sandbox_connection_cap
from clawpipe.sandbox.manifest import HarnessManifest
from clawpipe.sandbox.precheck import check_proxy, check_specs
from clawpipe.sandbox.quota import mount_quota, release, sweep_stale_mounts
from clawpipe.sandbox.rollout import ProgressFn, RolloutResult, RolloutSpec, TaskSetLike, now_iso
from clawpipe.sandbox.uids import SHARED_USER, SandboxUser, UidLease, UidPool, default_pool
from clawpipe.sandbox.verify import preflight
from clawpipe.sandbox.workdir import chown_tree, open_tree, release_rollout_dir, tail
from clawpipe.schemas import RolloutStatus
from clawpipe.tasks.base import harness_view

logger = logging.getLogger(__name__)


class _Batch:
    """Shared state of one run_rollouts call."""

    def __init__(
        self,
        *,
        backend: Backend,
        bridge: Bridge,
        secret: bytes,
        scratch: Path,
        results_path: Callable[[RolloutSpec], Path],
        task_sets: Mapping[str, TaskSetLike],
        max_attempts: int,
        keep_workdirs: bool,
        timeout_s: float | None,
        uids: UidPool | None,
        verify_timeout_s: float | None = None,
    ) -> None:
        self.backend = backend
        self.uids = uids  # None: the process backend, whose harnesses run as the runner's own user
        self.bridge = bridge
        self.secret = secret
        self.scratch = scratch
        self.results_path = results_path
        self.task_sets = dict(task_sets)
        self.max_attempts = max_attempts
        self.keep_workdirs = keep_workdirs
        self.timeout_s = timeout_s
        self.verify_timeout_s = verify_timeout_s
        self.releaser: ThreadPoolExecutor | None = None  # gives sandbox uids back (see give_back)
        self._lock = threading.Lock()

    def task_set(self, name: str) -> TaskSetLike:
        with self._lock:
            if name not in self.task_sets:
                from clawpipe.tasks import get_task_set

                self.task_sets[name] = get_task_set(name)
            return self.task_sets[name]

    def lease(self) -> UidLease:
        """A host uid of the rollout's own for its sandbox (SandboxError when none comes free: an infra error)."""
        return self.uids.lease() if self.uids is not None else UidLease(SHARED_USER, None)

    def give_back(self, lease: UidLease) -> None:
        """Release ``lease`` off the rollout's path: its sweep scans every process on the host (a tenth of a
        second with 5,000), while the uid stays locked until the sweep is done. Once the batch is
        over, it runs in the calling thread."""
        if self.releaser is not None:
            try:
                self.releaser.submit(lease.release)
                return
            except RuntimeError:  # shut down: the batch is ending
                pass
        lease.release()

    def prepare_dir(self, spec: RolloutSpec, manifest: HarnessManifest, user: SandboxUser) -> Path:
        rdir = self.scratch / spec.run_id / f"iter-{spec.iteration}" / spec.id
        release(rdir)  # a rerun's leftovers, also a tmpfs that a killed runner left mounted
        rdir.mkdir(parents=True)
        mount_quota(rdir, manifest.limits.disk_mb)  # work dir, task and logs share the rollout's disk quota
        try:
            work = rdir / "work"
            (work / "out").mkdir(parents=True)
            (work / "home").mkdir()
            # What only the verifier may know (an answer, held-out cases) stays here, on the host.
            view = harness_view(spec.task, self.task_set(spec.task["task_set"]))
            (rdir / "task.json").write_text(json.dumps(view))
            (rdir / "task.json").chmod(0o644)
            self.task_set(spec.task["task_set"]).prepare(spec.task, work)
            if self.backend.name != "process":
                if os.geteuid() == 0:
                    chown_tree(work, user.uid, user.gid)
                else:  # e.g. docker as a member of the docker group: let the sandbox's uid write anyway
                    open_tree(work)
        except BaseException:  # the caller never learns of this folder: its tmpfs would stay mounted
            release(rdir)
            raise
        return rdir

    def run_one(self, spec: RolloutSpec, manifest: HarnessManifest) -> RolloutResult:
        task = spec.task
        result = RolloutResult(
            rollout_id=spec.id,
            run_id=spec.run_id,
            iteration=spec.iteration,
            group_id=spec.group,
            harness=manifest.name,
            task_set=task["task_set"],
            task_id=task["task_id"],
            sample_idx=spec.sample_idx,
            backend=self.backend.name,
            status=RolloutStatus.infra_error,
            policy_version=spec.policy_version,
            eval=spec.eval,
            started_at=now_iso(),
        )
        t0 = time.monotonic()
        key = mint_key(self.secret, run_id=spec.run_id, iteration=spec.iteration, rollout_id=spec.id)
        timeout = self.timeout_s or manifest.timeout_s
        rdir: Path | None = None
        outcome: Outcome | None = None
        for attempt in range(1, self.max_attempts + 1):
            result.attempt = attempt
            try:
                # The uid is the sandbox's alone from before its work dir is made until its processes are gone.
                lease = self.lease()
                try:
                    rdir = self.prepare_dir(spec, manifest, lease.user)
                    job = SandboxJob(spec.id, manifest, rdir, key, spec.model, timeout, manifest.limits, lease.user)
                    ran = self.backend.run(job, self.bridge)
                finally:
                    self.give_back(lease)
                if ran.proxy_unreachable:  # whatever the harness made of failed calls, they were not its fault
                    raise SandboxError(f"the harness could not reach the proxy: {'; '.join(ran.notes)}")
                outcome = ran
                break
            except SandboxError as exc:
                result.error = str(exc)
                if rdir is not None:
                    result.stderr_tail = tail(rdir / "stderr.log")
                logger.warning(
                    "rollout=%s attempt=%d infra error: %s stderr=%r", spec.id, attempt, exc, result.stderr_tail[-500:]
                )
                if attempt < self.max_attempts:
                    time.sleep(min(2.0, 0.2 * attempt))
            except Exception as exc:  # a task set's prepare() or our own bug: not the harness's fault
                result.error = f"{type(exc).__name__}: {exc}"
                logger.exception("rollout=%s setup failed", spec.id)
                break
        if outcome is not None and rdir is not None:
            try:
                conclude(result, outcome, rdir, manifest.limits, timeout)
                score(
                    result,
                    spec,
                    rdir / "work",
                    task_set=self.task_set,
                    backend=self.backend,
                    uids=self.uids,
                    timeout_s=self.verify_timeout_s,
                )
            except Exception as exc:  # our own failure on what the harness left: the rollout still gets its row
                logger.exception("rollout=%s could not be concluded", spec.id)
                result.status = RolloutStatus.infra_error
                result.error = f"after the harness exited: {type(exc).__name__}: {exc}"
        result.ended_at = now_iso()
        result.duration_s = round(time.monotonic() - t0, 4)
        path = self.results_path(spec)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            append_result(path, result.to_row())
        if rdir is not None:
            release_rollout_dir(rdir, keep=self.keep_workdirs)
            if self.keep_workdirs and rdir.is_dir():
                result.workdir = str(rdir / "work")
        return result


def default_results_path(run_id: str, iteration: int, batch: str, captures_dir: Path | None = None) -> Path:
    """<captures>/results/<run_id>/<iteration>/results-<batch>.jsonl (docs/ARCHITECTURE.md, contract D)."""
    if captures_dir is None:
        from clawpipe.config import get_settings

        captures_dir = get_settings().captures_dir
    return captures_dir / "results" / run_id / str(iteration) / f"results-{batch}.jsonl"


def iter_rollouts(
    specs: Iterable[RolloutSpec],
    *,
    proxy_url: str,
    backend: str | Backend = "bwrap",
    concurrency: int = 8,
    results_path: str | Path | None = None,
    secret: bytes | None = None,
    scratch_dir: str | Path | None = None,
    task_sets: Mapping[str, TaskSetLike] | None = None,
    harness_dirs: Iterable[str | Path] | None = None,
    max_attempts: int = 3,
    keep_workdirs: bool = False,
    timeout_s: float | None = None,
    batch_id: str | None = None,
    bridge_max_connections: int = DEFAULT_MAX_CONNECTIONS,
    bridge_idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    uid_pool: UidPool | None = None,
    verify_timeout_s: float | None = None,
    halt: threading.Event | None = None,
) -> Iterator[RolloutResult]:
    """Run rollouts and yield each result as it finishes (order of completion). See :func:`run_rollouts`."""
    spec_list = list(specs)
    dirs = [Path(d) for d in harness_dirs] if harness_dirs is not None else None
    manifests = check_specs(spec_list, dirs)
    if concurrency < 1 or max_attempts < 1:
        raise ConfigError(f"concurrency and max_attempts must be >= 1, got {concurrency} and {max_attempts}")
    if verify_timeout_s is not None and not verify_timeout_s > 0:
        raise ConfigError(f"verify_timeout_s must be > 0 seconds, got {verify_timeout_s}")
    if not spec_list:
        return
    from clawpipe.config import get_settings

    settings = get_settings()
    secret = secret if secret is not None else settings.secret()
    batch = batch_id or uuid.uuid4().hex[:12]
    fixed = Path(results_path) if results_path is not None else None

    def path_for(spec: RolloutSpec) -> Path:
        return fixed or default_results_path(spec.run_id, spec.iteration, batch, settings.captures_dir)

    scratch = Path(scratch_dir) if scratch_dir is not None else settings.runs_dir / "rollouts"
    check_proxy(proxy_url)
    owned_backend = isinstance(backend, str)
    wants_uids = backend != "process" if isinstance(backend, str) else takes_own_uids(backend)
    uids = (uid_pool or default_pool()) if wants_uids else None
    if uids is not None:
        uids.check(concurrency)
    sweep_stale_mounts()  # rollout folders a killed runner left mounted
    be = get_backend(backend) if isinstance(backend, str) else backend
    if not takes_own_uids(be):
        uids = None  # its sandboxes run as the runner's user or as 65534
    try:
        cap = sandbox_connection_cap(concurrency, bridge_max_connections)
        with Bridge(proxy_url, max_connections=cap, idle_timeout_s=bridge_idle_timeout_s) as bridge:
            state = _Batch(
                backend=be,
                bridge=bridge,
                secret=secret,
                scratch=scratch,
                results_path=path_for,
                task_sets=task_sets or {},
                max_attempts=max_attempts,
                keep_workdirs=keep_workdirs,
                timeout_s=timeout_s,
                uids=uids,
                verify_timeout_s=verify_timeout_s if verify_timeout_s is not None else settings.verify_timeout_s,
            )
            preflight(be.name, (s.task["task_set"] for s in spec_list), state.task_set)
            with (
                ThreadPoolExecutor(max_workers=2, thread_name_prefix="uid-release") as state.releaser,
                ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="rollout") as pool,
            ):
                pending: set[Future[RolloutResult]] = set()
                submitted = 0
                halted: Callable[[], bool] = halt.is_set if halt is not None else lambda: False
                try:
                    for i in range(len(spec_list)):  # keep at most 2x concurrency futures alive: memory stays flat
                        if halted():
                            break
                        pending.add(pool.submit(state.run_one, spec_list[i], manifests[i]))
                        submitted += 1
                        if len(pending) >= 2 * concurrency:
                            done, pending = _wait_one(pending, halt)
                            for f in done:
                                yield f.result()
                    while pending and not halted():
                        done, pending = _wait_one(pending, halt)
                        for f in done:
                            yield f.result()
                    if halted():
                        not_started = len(spec_list) - submitted + sum(f.cancel() for f in pending)
                        raise Halted(
                            f"batch {batch}: the run is stopping; the rollouts under way finish (their results "
                            f"are written), {not_started} not started"
                        )
                finally:
                    for f in pending:
                        f.cancel()
    finally:
        if owned_backend:
            with contextlib.suppress(Exception):
                be.close()


HALT_POLL_S = 0.5  # how often a batch waiting on its rollouts looks at its halt event


def _wait_one(
    pending: set[Future[RolloutResult]], halt: threading.Event | None
) -> tuple[set[Future[RolloutResult]], set[Future[RolloutResult]]]:
    """(done, still pending) once a rollout is done, or once ``halt`` is set (done may then be empty)."""
    while True:
        done, rest = wait(pending, timeout=None if halt is None else HALT_POLL_S, return_when=FIRST_COMPLETED)
        if done or (halt is not None and halt.is_set()):
            return done, rest


def run_rollouts(
    specs: Iterable[RolloutSpec],
    *,
    proxy_url: str,
    backend: str | Backend = "bwrap",
    concurrency: int = 8,
    results_path: str | Path | None = None,
    progress: ProgressFn | None = None,
    **options: Any,
) -> list[RolloutResult]:
    """Run every spec against the proxy at ``proxy_url``; return the results in the order of ``specs``.

    Each result row is appended to ``results_path`` (default: the contract D path of docs/ARCHITECTURE.md
    under the project's captures dir) as soon as it is known. ``backend`` is "bwrap" (default), "docker", "process" or a
    Backend instance. ``progress(result, done, total)`` is called after each rollout. Other options:
    secret, scratch_dir, task_sets (name -> task set, default clawpipe.tasks.get_task_set), harness_dirs,
    max_attempts (infra retries), keep_workdirs, timeout_s (overrides the manifests'), batch_id,
    bridge_max_connections (open connections per sandbox; more are refused and make the rollout failed,
    still scored; lowered to fit the runner's descriptor limit), bridge_idle_timeout_s and uid_pool (the
    host uids sandboxes run as, one each; default the range CLAWPIPE_SANDBOX_UID_BASE/_COUNT describe) and
    verify_timeout_s (seconds a task set's verifier may run on the host per rollout, default
    CLAWPIPE_VERIFY_TIMEOUT_S; past it that rollout is an infra error naming the limit, the batch goes on)
    and halt (a ``threading.Event``: once set, no further rollout starts, those under way finish and write
    their results, and :class:`~clawpipe.errors.Halted` is raised; how a run stopping reaches a batch that
    runs in a worker thread). Raises ManifestError/ConfigError before anything runs if a manifest, task or
    id is invalid.
    """
    spec_list = list(specs)
    order = {(s.run_id, s.iteration, s.id): i for i, s in enumerate(spec_list)}
    results: list[RolloutResult | None] = [None] * len(spec_list)
    stream = iter_rollouts(
        spec_list, proxy_url=proxy_url, backend=backend, concurrency=concurrency, results_path=results_path, **options
    )
    for done, r in enumerate(stream, 1):
        results[order[(r.run_id, r.iteration, r.rollout_id)]] = r
        if progress is not None:
            progress(r, done, len(spec_list))
    return [r for r in results if r is not None]
