"""Cancellation of a pipeline flow run from the Prefect UI or API (``prefect flow-run cancel``).

Prefect stops a cancelled run only where a worker or runner started it: for a run started by ``clawpipe
run`` nobody acts on the Cancelling state, and the run went on to its end. :class:`CancelWatch` watches the
run's state from a thread and, once it turns Cancelling, sends this process SIGTERM: Prefect raises
``TerminationSignal`` in the main thread wherever it is (a rollout batch, a training step), so the same
unwinding as a ``kill`` stops the sandboxes, the policy server, the proxy and the training process, and
the flow then ends its run as Cancelled (flows/pipeline.py).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.logging import get_logger

log = get_logger("cancel")  # under Prefect's logger, so the run's console shows it beside the flow's lines

POLL_S = 2.0


class CancelWatch:
    """Polls flow run ``flow_run_id`` every ``poll_s`` seconds while the block runs; ``requested`` tells
    whether the run was cancelled through Prefect (and this process signalled)."""

    def __init__(self, flow_run_id: str | UUID | None, poll_s: float = POLL_S) -> None:
        self.flow_run_id = UUID(str(flow_run_id)) if flow_run_id else None
        self.poll_s = poll_s
        self.requested = False
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
        failures = 0
        with get_client(sync_client=True) as client:
            while not self._stop.wait(self.poll_s):
                try:
                    state: Any = client.read_flow_run(self.flow_run_id).state  # type: ignore[arg-type]
                except Exception as exc:  # the API away for a moment must not end the run; said once
                    failures += 1
                    if failures == 1:
                        log.warning("cannot read the flow run's state to watch for cancellation: %s", exc)
                    continue
                failures = 0
                if state is not None and (state.is_cancelling() or state.is_cancelled()):
                    self._cancel()
                    return

    def _cancel(self) -> None:
        with self._signal_lock:
            if not self._stop.is_set():
                log.info("flow run %s was cancelled through Prefect: stopping the run", self.flow_run_id)
                self.requested = True
                os.kill(os.getpid(), signal.SIGTERM)  # Prefect's handler raises TerminationSignal in main
