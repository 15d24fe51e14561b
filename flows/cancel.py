"""Cancellation of a pipeline flow run from the Prefect UI or API (``prefect flow-run cancel``).

Prefect stops a cancelled run only where a worker or runner started it: for a run started by ``clawpipe
run`` nobody acts on the Cancelling state, and the run went on to its end. :class:`CancelWatch` watches the
run's state from a thread and, once it turns Cancelling, sends this process SIGTERM: Prefect raises
``TerminationSignal`` in the main thread wherever it is (a rollout batch, a training step), so the same
unwinding as a ``kill`` stops the sandboxes, the policy server, the proxy and the training process, and
the flow then ends its run as Cancelled (flows/pipeline.py).

The UI shows the run's subflows beside it (an iteration; in async mode the rollout producer, the trainer
and its steps), and cancelling one of those is cancelling the run: the watch follows the running
descendants of the run's flow run too (a level deeper each poll), and a Cancelling one stops the run the
same way. Once stopped, the subflows the signal cut short end Cancelled (:meth:`CancelWatch.settle`), not
Crashed or Running. A rollout shard (a flow run of the rollout-shard deployment on a pool's worker) is not
this process's: cancelling one stops that shard only, and its rollouts run again (clawpipe/pipeline/fanout.py).
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterParentFlowRunId,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.sorting import FlowRunSort
from prefect.logging import get_logger
from prefect.states import Cancelled

log = get_logger("cancel")  # under Prefect's logger, so the run's console shows it beside the flow's lines

POLL_S = 2.0


class CancelWatch:
    """Polls flow run ``flow_run_id`` every ``poll_s`` seconds while the block runs; ``requested`` tells
    whether the run was cancelled through Prefect (and this process signalled)."""

    def __init__(self, flow_run_id: str | UUID | None, poll_s: float = POLL_S) -> None:
        self.flow_run_id = UUID(str(flow_run_id)) if flow_run_id else None
        self.poll_s = poll_s
        self.requested = False
        self.stopped_at: datetime.datetime | None = None  # when the cancel was asked, by the server's clock
        self._stop = threading.Event()
        self._signal_lock = threading.Lock()  # no SIGTERM once the block has been left
        self._thread = threading.Thread(target=self._loop, name="cancel-watch", daemon=True)

    def __enter__(self) -> CancelWatch:
        if self.flow_run_id is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._signal_lock:
            self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.poll_s + 10)

    def _loop(self) -> None:
        root = self.flow_run_id
        assert root is not None  # started only with a flow run to watch
        failures = 0
        running: list[UUID] = []  # the run's running subflows met so far: their children are looked at next
        with get_client(sync_client=True) as client:
            while not self._stop.wait(self.poll_s):
                try:
                    state: Any = client.read_flow_run(root).state
                    children = _subflows(client, [root, *running], [StateType.RUNNING, StateType.CANCELLING])
                except Exception as exc:  # the API away for a moment must not end the run; said once
                    failures += 1
                    if failures == 1:
                        log.warning("cannot read the flow run's state to watch for cancellation: %s", exc)
                    continue
                failures = 0
                if state is not None and (state.is_cancelling() or state.is_cancelled()):
                    self._cancel(f"flow run {root}", state.timestamp)
                    return
                for child in children:
                    if child.state is not None and child.state.is_cancelling():
                        self._cancel(f"flow run {child.name} ({child.id}) of this run", child.state.timestamp)
                        return
                running = [c.id for c in children]

    def _cancel(self, what: str, at: datetime.datetime) -> None:
        with self._signal_lock:
            if not self._stop.is_set():
                log.info("%s was cancelled through Prefect: stopping the run", what)
                self.requested = True
                self.stopped_at = at
                os.kill(os.getpid(), signal.SIGTERM)  # Prefect's handler raises TerminationSignal in main

    def settle(self, message: str) -> None:
        """Once a cancelled run has stopped: the subflows of its flow run that the signal cut short (left
        Running, Cancelling or Crashed by their own unwinding) end Cancelled, the cancelled one among them.
        Best effort: the run stopped either way."""
        if not self.requested or self.flow_run_id is None or self.stopped_at is None:
            return
        since = self.stopped_at  # the server's clock, as are the subflows' state times
        cut: list[Any] = []
        try:
            with get_client(sync_client=True) as client:
                parents = [self.flow_run_id]
                while parents:  # a level at a time: an iteration, then its steps' subflows
                    level = [
                        run
                        for run in _subflows(client, parents, [*_CUT, StateType.CRASHED])
                        if run.state is not None and (run.state.type in _CUT or run.state.timestamp >= since)
                    ]
                    cut += level
                    parents = [run.id for run in level]
                for run in cut:
                    client.set_flow_run_state(run.id, Cancelled(message=message), force=True)
        except Exception as exc:
            log.warning("could not mark the subflows of the cancelled run Cancelled: %s", exc)


_CUT = [StateType.RUNNING, StateType.CANCELLING, StateType.PENDING]  # a subflow the signal stopped mid-way


def _subflows(client: Any, parents: list[UUID], states: list[StateType]) -> list[Any]:
    """This process's subflows of ``parents`` (not deployment runs such as rollout shards) in ``states``,
    every page of them (the server answers a page of its own default size per read)."""
    flow_run_filter = FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=parents),
        deployment_id=FlowRunFilterDeploymentId(is_null_=True),
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=states)),
    )
    found: list[Any] = []
    while True:
        page = list(client.read_flow_runs(flow_run_filter=flow_run_filter, sort=FlowRunSort.ID_DESC, offset=len(found)))
        if not page:
            return found
        found += page
