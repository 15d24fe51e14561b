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
same way; that subflow then ends Cancelled (:meth:`CancelWatch.settle`), not Crashed.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterParentFlowRunId,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
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
        self.subflow: tuple[UUID, str] | None = None  # (id, name) of the subflow whose cancel stopped the run
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
                    children = client.read_flow_runs(
                        flow_run_filter=FlowRunFilter(
                            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[root, *running]),
                            state=FlowRunFilterState(
                                type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.CANCELLING])
                            ),
                        )
                    )
                except Exception as exc:  # the API away for a moment must not end the run; said once
                    failures += 1
                    if failures == 1:
                        log.warning("cannot read the flow run's state to watch for cancellation: %s", exc)
                    continue
                failures = 0
                if state is not None and (state.is_cancelling() or state.is_cancelled()):
                    self._cancel(f"flow run {root}")
                    return
                for child in children:
                    if child.state is not None and child.state.is_cancelling():
                        self.subflow = (child.id, child.name)
                        self._cancel(f"flow run {child.name} ({child.id}) of this run")
                        return
                running = [c.id for c in children]

    def _cancel(self, what: str) -> None:
        with self._signal_lock:
            if not self._stop.is_set():
                log.info("%s was cancelled through Prefect: stopping the run", what)
                self.requested = True
                os.kill(os.getpid(), signal.SIGTERM)  # Prefect's handler raises TerminationSignal in main

    def settle(self, message: str) -> None:
        """Once the run has stopped: the subflow whose cancel stopped it ends Cancelled (its own unwinding left
        it Cancelling or Crashed). Best effort: the run stopped either way."""
        if self.subflow is None:
            return
        flow_run_id, name = self.subflow
        try:
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(flow_run_id, Cancelled(message=message), force=True)
        except Exception as exc:
            log.warning("could not mark the cancelled flow run %s Cancelled: %s", name, exc)
