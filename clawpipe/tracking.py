"""Experiment tracking: the ONLY module that imports mlflow.

    tracker = make_tracker(enabled=True, experiment="clawpipe")
    tracker.start_run("run-1")                 # or attach: start_run(mlflow_run_id=...)
    tracker.log_params(config.flat_params())   # whole config, flattened; unchanged params are not re-sent
    tracker.log_metrics({"train/loss/total": 0.1, ...}, step=3)   # one batched call per step
    tracker.end()

:class:`NullTracker` has the same methods and does nothing, so callers never need an ``if``. The tracking
URI comes from clawpipe.config (sqlite under the project home unless CLAWPIPE_MLFLOW_TRACKING_URI is set).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from clawpipe.errors import ConfigError

log = logging.getLogger(__name__)

MAX_PARAM_LEN = 6000  # mlflow's limit on a param value


class Tracker(Protocol):
    def start_run(
        self, run_name: str | None = None, *, mlflow_run_id: str | None = None, tags: Mapping[str, str] | None = None
    ) -> str | None: ...
    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None: ...
    def end(self, status: str = "FINISHED") -> None: ...


class NullTracker:
    """Tracking switched off: every method is a no-op."""

    run_id: str | None = None

    def start_run(
        self, run_name: str | None = None, *, mlflow_run_id: str | None = None, tags: Mapping[str, str] | None = None
    ) -> str | None:
        return None

    def log_params(self, params: Mapping[str, Any]) -> None:
        return None

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        return None

    def end(self, status: str = "FINISHED") -> None:
        return None


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mappings to dotted keys with string values (truncated to MLflow's limit)."""
    out: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = str(value)[:MAX_PARAM_LEN]
    return out


class MlflowTracker:
    """Logs to MLflow with batched calls (one log_batch per step: log_metric in a loop is slow,
    docs/ARCHITECTURE.md)."""

    def __init__(self, experiment: str = "clawpipe", tracking_uri: str | None = None) -> None:
        import mlflow
        from clawpipe.config import get_settings

        self._mlflow = mlflow
        self.tracking_uri = tracking_uri or get_settings().tracking_uri
        self.experiment = experiment
        with _store_lock(self.tracking_uri):
            self.client = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        self.run_id: str | None = None
        self._logged: dict[str, str] = {}

    def start_run(
        self, run_name: str | None = None, *, mlflow_run_id: str | None = None, tags: Mapping[str, str] | None = None
    ) -> str:
        if mlflow_run_id is not None:
            self.run_id = mlflow_run_id
            existing = self.client.get_run(mlflow_run_id).data.params
            self._logged = dict(existing)
            return mlflow_run_id
        run = self.client.create_run(self._experiment_id(), run_name=run_name, tags=dict(tags or {}))
        self.run_id = run.info.run_id
        return self.run_id

    def _experiment_id(self) -> str:
        """The experiment's id, created on first use; under the store's lock, so runs started together on a
        fresh home do not both create it (the second would fail: the name exists)."""
        with _store_lock(self.tracking_uri):
            exp = self.client.get_experiment_by_name(self.experiment)
            if exp is not None:
                return str(exp.experiment_id)
            return str(
                self.client.create_experiment(self.experiment, artifact_location=_artifact_root(self.tracking_uri))
            )

    def _require_run(self) -> str:
        if self.run_id is None:
            self.start_run()
        assert self.run_id is not None
        return self.run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        run_id = self._require_run()
        flat = flatten(params)
        new = {k: v for k, v in flat.items() if k not in self._logged}
        changed = {k: v for k, v in flat.items() if k in self._logged and self._logged[k] != v}
        if changed:
            log.warning("params already logged with other values are kept as they were: %s", sorted(changed))
        items = [Param(k, v) for k, v in new.items()]
        for i in range(0, len(items), 100):  # MLflow accepts at most 100 params per batch
            self.client.log_batch(run_id, params=items[i : i + 100])
        self._logged.update(new)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        import time

        from mlflow.entities import Metric

        run_id = self._require_run()
        ts = int(time.time() * 1000)
        items = [
            Metric(k, float(v), ts, int(step or 0))
            for k, v in metrics.items()
            if isinstance(v, int | float) and math.isfinite(float(v))
        ]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i : i + 1000])

    def end(self, status: str = "FINISHED") -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status=status)


def _sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` tracking URI; None for any other store (or an in-memory one)."""
    if not uri.startswith("sqlite:///") or uri == "sqlite:///:memory:":
        return None
    return Path(uri.removeprefix("sqlite:///"))


@contextlib.contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """Make one client at a time of a sqlite store: the first client of a new database creates its tables,
    and two processes doing so at once (two runs started together on a fresh home) clash, one failing
    with ``duplicate column name``. A lock file beside the database, held with ``flock``, orders them."""
    db = _sqlite_file(uri)
    if db is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def _artifact_root(uri: str) -> str | None:
    """Artifacts of a sqlite store's experiments go beside the database (``<home>/mlartifacts``), not into the
    ``mlruns`` folder of whichever directory the run was started from; a server keeps its own default."""
    db = _sqlite_file(uri)
    return None if db is None else (db.parent / "mlartifacts").resolve().as_uri()


def check_tracking_uri(uri: str, timeout_s: float = 10.0) -> None:
    """Refuse a tracking URI that runs could not log to, before any work starts (MLflow itself retries an
    unreachable server for minutes and fails only then, after the run's policy was built).

    An http(s) server must answer its /health; a sqlite database or file store must sit in a folder this
    process can write to. Other schemes (databases, Databricks) are left to MLflow."""
    import urllib.parse

    parsed = urllib.parse.urlparse(uri)
    db = _sqlite_file(uri)
    if parsed.scheme in ("http", "https"):
        _check_server(uri, timeout_s)
    elif db is not None:
        _check_writable(db.parent, uri)
    elif parsed.scheme in ("", "file"):
        _check_writable(Path(parsed.path if parsed.scheme else uri), uri)


def _check_server(uri: str, timeout_s: float) -> None:
    from clawpipe.net import health_failure

    reason = health_failure(uri, timeout_s)
    if reason is not None:
        raise ConfigError(
            f"the MLflow tracking server {uri} does not answer ({reason}): start it (mlflow/server.sh HOST PORT), "
            "or unset CLAWPIPE_MLFLOW_TRACKING_URI to track in <home>/mlflow.db"
        )


def _check_writable(folder: Path, uri: str) -> None:
    """``folder`` (made if missing) takes a new file; tried for real, since os.access says yes to root."""
    fix = "choose a writable folder in CLAWPIPE_MLFLOW_TRACKING_URI, or unset it to track in <home>/mlflow.db"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".clawpipe-write-check-"):
            pass
    except OSError as exc:
        # mkdir under a file says "File exists" or "Not a directory"; name the file instead
        blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
        reason = f"{blocker} is a file" if blocker else exc.strerror
        raise ConfigError(f"MLflow tracking URI {uri}: cannot write in {folder} ({reason}); {fix}") from None


def make_tracker(
    enabled: bool = True, *, experiment: str = "clawpipe", tracking_uri: str | None = None
) -> MlflowTracker | NullTracker:
    """An MLflow tracker, or the null tracker when tracking is disabled."""
    if not enabled:
        return NullTracker()
    from clawpipe.config import prepare_environment

    prepare_environment()
    return MlflowTracker(experiment=experiment, tracking_uri=tracking_uri)
