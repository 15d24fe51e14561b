"""The ``rollout-shard`` flow: one shard of a rollout batch, run on a worker host of a work pool.

The pipeline's rollout stage (``rollout_pool`` set) submits each shard with ``run_deployment`` to the
``rollout-shard/rollout-shard`` deployment on the pool and watches it (the rules: splitting and the
worker's side in clawpipe/pipeline/shards.py, heartbeats and reruns under new ids in
clawpipe/pipeline/fanout.py). On the worker host, the flow holds its slots
of the host's Prefect global concurrency limit ``sandboxes-<host>`` (created with the host's slot
count, ``CLAWPIPE_HOST_SLOTS``, if absent) for as long as its sandboxes run, so every run on the host
shares one cap; the slots are leased, so a worker killed while holding them frees them when the lease
runs out. The host's capture proxy is started by the first shard that needs it (see
clawpipe/pipeline/services.py, ``host_proxy``).

``python -m flows.rollout_shard limit --slots N`` creates (or resizes) the host's limit; ``clawpipe
worker`` runs it before starting the Prefect worker.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import re
import sys
import threading
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from clawpipe.config import Settings, get_settings, prepare_environment

SETTINGS = prepare_environment()  # offline-safe Prefect/MLflow settings before either is imported

import httpx  # noqa: E402
from prefect import flow, get_run_logger  # noqa: E402
from prefect.client.orchestration import get_client  # noqa: E402
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate  # noqa: E402
from prefect.client.schemas.objects import State, StateType  # noqa: E402
from prefect.client.schemas.responses import SetStateStatus  # noqa: E402
from prefect.concurrency.sync import concurrency  # noqa: E402
from prefect.deployments import run_deployment  # noqa: E402
from prefect.exceptions import ObjectNotFound  # noqa: E402
from prefect.runtime import flow_run  # noqa: E402
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings  # noqa: E402
from prefect.states import Cancelled, Cancelling, Crashed  # noqa: E402

from clawpipe import objstore  # noqa: E402
from clawpipe.errors import ConfigError  # noqa: E402
from clawpipe.pipeline import fanout, shards  # noqa: E402
from clawpipe.pipeline.config import PipelineConfig  # noqa: E402
from clawpipe.pipeline.services import upstreams_of  # noqa: E402

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
FLOW = "rollout-shard"
DEPLOYMENT = f"{FLOW}/{FLOW}"
LEASE_S = 60  # the server's shortest lease: slots of a killed holder come back within a minute
CANCEL_TIMEOUT_S = 5.0  # each API call cancelling a shard of a stopping run (within fanout.CANCEL_S in all)


def limit_name(settings: Settings) -> str:
    """``sandboxes-<host>``: the host's cap on sandboxes, shared by every run on it."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", objstore.host_id(settings.captures_dir))
    return f"sandboxes-{host}"


def host_slots(settings: Settings) -> int:
    return settings.host_slots or os.cpu_count() or 1


def ensure_host_limit(settings: Settings, *, resize: bool = False) -> int:
    """Create the host's limit with its slot count if absent (``resize``: set it to that count); its slots."""
    name, slots = limit_name(settings), host_slots(settings)
    with get_client(sync_client=True) as client:
        try:
            found = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots))
            return slots
        if resize and found.limit != slots:
            client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=slots))
            return slots
        return int(found.limit)


def _shard_name() -> str:
    req = flow_run.parameters["request"]
    return f"{req['run_id']}-{req['batch_id']}.s{req['index']}.a{req['attempt']}"


@flow(name=FLOW, flow_run_name=_shard_name, log_prints=False)
def rollout_shard(request: dict[str, Any]) -> dict[str, Any]:
    """Run one shard's rollouts on this host within its sandbox slots; upload captures, then result rows."""
    req = shards.ShardRequest.from_params(request)
    settings = get_settings()
    cfg = PipelineConfig.model_validate(req.cfg)
    slots = ensure_host_limit(settings)
    occupy = max(1, min(len(req.rollout_ids), cfg.concurrency, slots))
    logger = get_run_logger()
    logger.info(
        "shard %s: %d rollouts, waiting for %d of %d slots of %s",
        req.key,
        len(req.rollout_ids),
        occupy,
        slots,
        limit_name(settings),
    )
    done = shards.run_shard(
        req,
        settings,
        concurrency=occupy,
        hold=lambda: concurrency(limit_name(settings), occupy=occupy, lease_duration=LEASE_S, strict=True),
    )
    logger.info("shard %s: reward %.3f, statuses %s", req.key, done["reward_mean"], done["statuses"])
    return done


# --- the pipeline's side ---------------------------------------------------------------------------


@functools.cache
def ensure_deployment(pool: str) -> str:
    """Register (or update) the rollout-shard deployment on the process pool ``pool``, once per process; its id."""
    from flows.deploy import ensure_pool

    ensure_pool(pool)
    source = flow.from_source(source=str(ROOT), entrypoint="flows/rollout_shard.py:rollout_shard")
    if isinstance(source, Coroutine):  # from_source is sync here; the union is for async callers
        raise TypeError("flow.from_source returned a coroutine in a sync context")
    deployment_id = source.deploy(name=FLOW, work_pool_name=pool, build=False, push=False, print_next_steps=False)
    return str(deployment_id)


_STATES = {
    StateType.SCHEDULED: "pending",
    StateType.PENDING: "starting",  # a worker took it and is starting its process
    StateType.PAUSED: "pending",
    StateType.RUNNING: "running",
    StateType.CANCELLING: "running",
    StateType.COMPLETED: "completed",
    StateType.FAILED: "failed",
    StateType.CRASHED: "failed",
    StateType.CANCELLED: "cancelled",
}


class PrefectShards:
    """Shards as flow runs of the rollout-shard deployment (a :class:`clawpipe.pipeline.fanout.ShardRunner`)."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self.client = get_client(sync_client=True)

    def submit(self, req: shards.ShardRequest) -> str:
        run = run_deployment(DEPLOYMENT, parameters={"request": req.to_params()}, timeout=0, as_subflow=True)
        if isinstance(run, Coroutine):  # run_deployment is sync here; the union is for async callers
            raise TypeError("run_deployment returned a coroutine in a sync context")
        return str(run.id)

    def state(self, handle: str) -> str:
        state = self.client.read_flow_run(uuid.UUID(handle)).state
        return _STATES.get(state.type, "pending") if state is not None else "pending"

    def give_up(self, handle: str, reason: str) -> None:
        self.client.set_flow_run_state(uuid.UUID(handle), Crashed(message=reason), force=True)

    def cancel(self, handle: str, reason: str) -> bool:
        """Cancelling where a worker has taken it (the worker stops its process and ends it Cancelled);
        Cancelled where none has yet. Proposed, not forced: the server refuses it for a shard that ended
        meanwhile (False: it had ended). Asked on a client of its own with one short try per call, as a
        stopping run cannot wait out the API's retries."""
        run_id = uuid.UUID(handle)
        timeout = httpx.Timeout(CANCEL_TIMEOUT_S)
        with (
            temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0}),
            get_client(httpx_settings={"timeout": timeout}, sync_client=True) as client,
        ):
            state = client.read_flow_run(run_id).state
            if state is not None and (state.is_final() or state.is_cancelling()):
                return not state.is_final()
            taken = state is not None and state.type in (StateType.PENDING, StateType.RUNNING)
            proposed: State[Any] = (Cancelling if taken else Cancelled)(message=reason)
            return client.set_flow_run_state(run_id, proposed).status == SetStateStatus.ACCEPT


def fan_out_batch(
    cfg: PipelineConfig, specs: list[Any], *, proxy_url: str, batch_id: str, halt: threading.Event | None = None
) -> dict[str, Any]:
    """The rollout stage with ``rollout_pool``: the batch's shards run on the pool's workers (cancelled when
    the run stops; ``halt``: see clawpipe/pipeline/fanout.py)."""
    if not os.environ.get("PREFECT_API_URL"):
        raise ConfigError(
            "rollout_pool needs a Prefect server that workers share: start one (prefect server start) and set "
            "PREFECT_API_URL here and on every worker host; an ephemeral server has no workers"
        )
    assert cfg.rollout_pool is not None
    settings = get_settings()
    ensure_deployment(cfg.rollout_pool)
    upstreams = upstreams_of(proxy_url, settings.admin())
    runner = PrefectShards(cfg.rollout_pool)
    with runner.client:
        return fanout.fan_out(
            cfg,
            specs,
            runner=runner,
            settings=settings,
            batch_id=batch_id,
            upstreams=upstreams,
            halt=halt,
            logger=get_run_logger(),
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.rollout_shard", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    lim = sub.add_parser("limit", help="create or resize this host's sandbox limit")
    lim.add_argument("--slots", type=int, help="sandboxes at once on this host (default CLAWPIPE_HOST_SLOTS or CPUs)")
    a = p.parse_args(argv)
    settings = get_settings()
    if a.slots:
        settings = settings.model_copy(update={"host_slots": a.slots})
    slots = ensure_host_limit(settings, resize=True)
    print(f"global concurrency limit {limit_name(settings)}: {slots} slots")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main())
