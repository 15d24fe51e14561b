"""Experiment tracking: the ONLY module that imports mlflow.

    tracker = make_tracker(enabled=True, experiment="clawpipe")
    tracker.start_run("run-1")                 # or attach: start_run(mlflow_run_id=...)
    tracker.log_params(config.flat_params())   # whole config, flattened; unchanged params are not re-sent
    tracker.log_metrics({"train/loss/total": 0.1, ...}, step=3)   # one batched call per step
    tracker.log_text(toml_text, "config.toml")                   # an artifact of the run
    tracker.end()

:class:`NullTracker` has the same methods and does nothing, so callers never need an ``if``. The tracking
URI comes from clawpipe.config (sqlite under the project home unless CLAWPIPE_MLFLOW_TRACKING_URI is set).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

from clawpipe.errors import ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_PARAM_LEN = 6000  # MLflow's limit on a param value, in characters
MAX_KEY_LEN = 250  # MLflow's limit on a param or metric name
_BAD_NAME_CHARS = re.compile(r"[^/\w.\- :]")  # what MLflow refuses in a name (it allows \w, / . - space :)
# errors of a store that answered and refused one request (a deleted run, a bad value): said, not an outage
_REFUSALS = frozenset(
    {"INVALID_PARAMETER_VALUE", "INVALID_STATE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS", "BAD_REQUEST"}
)
_RETRY_AFTER_S = 60.0  # a tracking store that failed is tried again this long after, not on every call
# MLflow retries a request to a server that is away for minutes (7 retries, backoff factor 2); a run's
# logging must not stall its iterations that long, so a few quick retries, then the store counts as away.
_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}


class Tracker(Protocol):
    def start_run(
        self, run_name: str | None = None, *, mlflow_run_id: str | None = None, tags: Mapping[str, str] | None = None
    ) -> str | None: ...
    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def set_tags(self, tags: Mapping[str, str]) -> None: ...
    def mark_running(self) -> None: ...
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

    def log_text(self, text: str, artifact_file: str) -> None:
        return None

    def set_tags(self, tags: Mapping[str, str]) -> None:
        return None

    def mark_running(self) -> None:
        return None

    def end(self, status: str = "FINISHED") -> None:
        return None


def tracking_name(name: str) -> str:
    """``name`` as MLflow takes it for a param or metric: characters it refuses become ``_``, path-like parts
    (``//``, ``./``, ``../``, a leading ``/``) are flattened, and a name over 250 characters is cut, ending in
    8 hex digits of its hash so that two long names stay apart."""
    out = _BAD_NAME_CHARS.sub("_", name)
    parts = [p if p not in (".", "..") else p.replace(".", "_") for p in out.split("/") if p]
    out = "/".join(parts) or "_"
    if len(out) > MAX_KEY_LEN:
        digest = hashlib.sha1(name.encode()).hexdigest()[:8]
        out = f"{out[: MAX_KEY_LEN - 9]}-{digest}"
    return out


def param_value(value: object) -> str:
    """``str(value)``, or for one over MLflow's 6000 characters its start and a note of its full length and
    hash (two long values differing near their end stay different)."""
    text = str(value)
    if len(text) <= MAX_PARAM_LEN:
        return text
    note = f"...[{len(text)} chars, sha1 {hashlib.sha1(text.encode()).hexdigest()[:12]}]"
    return text[: MAX_PARAM_LEN - len(note)] + note


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mappings to dotted keys with string values (shortened to MLflow's limit, see param_value)."""
    out: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = param_value(value)
    return out


class _Outage:
    """A tracking store that stopped answering, per URI and process: said once when it fails, retried
    every ``_RETRY_AFTER_S`` seconds (the calls between are dropped and counted), said once when back."""

    def __init__(self) -> None:
        self.down_since: float | None = None
        self.retry_at = 0.0
        self.dropped = 0


_OUTAGES: dict[str, _Outage] = {}


class MlflowTracker:
    """Logs to MLflow with batched calls (one log_batch per step: log_metric in a loop is slow,
    docs/ARCHITECTURE.md).

    Logging never fails the run: names MLflow refuses are rewritten (:func:`tracking_name`), long param
    values shortened (:func:`param_value`), and a store that stops answering is reported once, with the
    calls dropped meanwhile counted when it answers again. Attached to an existing run (a resumed run,
    a training step), a (metric, step) point already there is not logged a second time."""

    def __init__(self, experiment: str = "clawpipe", tracking_uri: str | None = None) -> None:
        import mlflow
        from clawpipe.config import get_settings

        self._mlflow = mlflow
        self.tracking_uri = tracking_uri or get_settings().tracking_uri
        if self.tracking_uri.startswith(("http://", "https://")):
            for key, value in _HTTP_DEFAULTS.items():
                os.environ.setdefault(key, value)
        self.experiment = experiment
        with _store_lock(self.tracking_uri):
            self.client = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        self.run_id: str | None = None
        self._logged: dict[str, str] = {}
        self._latest_step: dict[str, int] = {}  # of each metric already in an attached run
        self._steps: dict[str, set[int]] = {}  # steps of a metric known to be logged (history read on need)
        self._outage = _OUTAGES.setdefault(self.tracking_uri, _Outage())

    def _call(self, what: str, fn: Callable[[], T]) -> T | None:
        """``fn()``, or None when the store fails (said once per outage) or is away until its retry time."""
        import time

        outage = self._outage
        if outage.down_since is not None and time.monotonic() < outage.retry_at:
            outage.dropped += 1
            return None
        try:
            result = fn()
        except Exception as exc:
            if getattr(exc, "error_code", None) in _REFUSALS:  # the store answered: no outage, the run goes on
                log.warning("MLflow at %s refused to %s: %s", self.tracking_uri, what, str(exc)[:300])
                return None
            if outage.down_since is None:
                outage.down_since = time.monotonic()
                log.warning(
                    "MLflow at %s failed to %s (%s: %s); the run goes on without tracking until it answers "
                    "again (tried every %.0f s, said once)",
                    self.tracking_uri,
                    what,
                    type(exc).__name__,
                    str(exc).splitlines()[0][:300] if str(exc) else "",
                    _RETRY_AFTER_S,
                )
            outage.dropped += 1
            outage.retry_at = time.monotonic() + _RETRY_AFTER_S
            return None
        if outage.down_since is not None:
            log.warning(
                "MLflow at %s answers again after %.0f s; %d tracking call(s) of this process were dropped meanwhile",
                self.tracking_uri,
                time.monotonic() - outage.down_since,
                outage.dropped,
            )
            outage.down_since, outage.dropped = None, 0
        return result

    def _done(self, what: str, fn: Callable[[], object]) -> bool:
        """Whether ``fn()`` (a call that returns nothing) reached the store."""
        return self._call(what, lambda: (fn(), True)[1]) is not None

    def start_run(
        self, run_name: str | None = None, *, mlflow_run_id: str | None = None, tags: Mapping[str, str] | None = None
    ) -> str | None:
        if mlflow_run_id is not None:
            self.run_id = mlflow_run_id
            run = self._call("read the run", lambda: self.client.get_run(mlflow_run_id))
            if run is not None:
                self._logged = dict(run.data.params)
                latest = getattr(run.data, "_metric_objs", None)
                if latest is None:  # no steps given: every existing metric's history is read when logged to
                    self._latest_step = {k: -1 for k in run.data.metrics}
                else:
                    self._latest_step = {m.key: int(m.step) for m in latest}
            return mlflow_run_id
        # a tag MLflow refuses would refuse the whole run: names and values are made acceptable, as params are
        safe_tags = {tracking_name(k): param_value(v) for k, v in (tags or {}).items()}
        run = self._call(
            "create a run",
            lambda: self.client.create_run(self._experiment_id(), run_name=run_name, tags=safe_tags),
        )
        self.run_id = None if run is None else run.info.run_id
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

    def _require_run(self) -> str | None:
        if self.run_id is None:
            self.start_run()
        return self.run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        run_id = self._require_run()
        if run_id is None:
            return
        flat = {tracking_name(k): v for k, v in flatten(params).items()}
        new = {k: v for k, v in flat.items() if k not in self._logged}
        changed = {k: v for k, v in flat.items() if k in self._logged and self._logged[k] != v}
        if changed:
            log.warning("params already logged with other values are kept as they were: %s", sorted(changed))
        items = [Param(k, v) for k, v in new.items()]
        for i in range(0, len(items), 100):  # MLflow accepts at most 100 params per batch
            batch = items[i : i + 100]
            if not self._done("log params", functools.partial(self.client.log_batch, run_id, params=batch)):
                return  # the rest would fail alike; not marked as logged, so a later call sends them
            self._logged.update((p.key, p.value) for p in batch)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        import time

        from mlflow.entities import Metric

        run_id = self._require_run()
        if run_id is None:
            return
        ts, at = int(time.time() * 1000), int(step or 0)
        items = [
            Metric(tracking_name(k), float(v), ts, at)
            for k, v in metrics.items()
            if isinstance(v, int | float) and math.isfinite(float(v))
        ]
        fresh = [m for m in items if not self._has_point(run_id, m.key, at)]
        if len(fresh) < len(items):
            log.info(
                "step %d: %d metric(s) already logged at this step are kept, not logged twice",
                at,
                len(items) - len(fresh),
            )
        for i in range(0, len(fresh), 1000):
            batch = fresh[i : i + 1000]
            if not self._done("log metrics", functools.partial(self.client.log_batch, run_id, metrics=batch)):
                return
            for m in batch:
                self._steps.setdefault(m.key, set()).add(at)

    def _has_point(self, run_id: str, key: str, step: int) -> bool:
        """Whether the run holds ``key`` at ``step`` already (a resumed run redoing a cut-off iteration)."""
        if key in self._steps and step in self._steps[key]:
            return True
        latest = self._latest_step.get(key)
        if latest is None or (latest >= 0 and step > latest) or key in self._steps:
            return False  # a new metric, or a step after the run's last one: nothing to read
        history = self._call("read metric history", lambda: self.client.get_metric_history(run_id, key))
        self._steps[key] = {int(m.step) for m in history or []}
        return step in self._steps[key]

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store ``text`` as the run's artifact ``artifact_file`` (e.g. ``config.toml``); dropped, like any
        call, when the store is away."""
        run_id = self.run_id
        if run_id is not None:
            self._done(
                f"log artifact {artifact_file}", functools.partial(self.client.log_text, run_id, text, artifact_file)
            )

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set (or replace) tags of the run, named and cut as params are, in one call."""
        from mlflow.entities import RunTag

        run_id = self.run_id
        if run_id is not None and tags:
            items = [RunTag(tracking_name(k), param_value(v)) for k, v in tags.items()]
            self._done("set tags", functools.partial(self.client.log_batch, run_id, tags=items))

    def mark_running(self) -> None:
        """Show the run as RUNNING again (a resumed run whose earlier process ended it KILLED or FAILED)."""
        run_id = self.run_id
        if run_id is not None:
            self._call("mark the run running", lambda: self.client.update_run(run_id, status="RUNNING"))

    def end(self, status: str = "FINISHED") -> None:
        run_id = self.run_id
        if run_id is not None:
            self._call(f"end the run as {status}", lambda: self.client.set_terminated(run_id, status=status))


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
