"""The environment, declared and checked in one place.

Every environment variable clawpipe honours is a field of :class:`Settings` (prefix ``CLAWPIPE_``); a few
are read again where they are used (the lake's lease, the object store, capture upload, the train step),
and are fields here all the same so that a bad value is refused, naming it, when a command starts.
:func:`prepare_environment` also sets the offline-safe Prefect and MLflow variables measured in
docs/ARCHITECTURE.md (pitfalls), and must run before either library is imported (the CLI and flows call it first).
"""

from __future__ import annotations

import functools
import os
import secrets
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from clawpipe.errors import ConfigError


class Settings(BaseSettings):
    """Machine-level settings, read from ``CLAWPIPE_*`` environment variables."""

    model_config = SettingsConfigDict(env_prefix="CLAWPIPE_", extra="ignore")

    home: Path = Field(
        default=Path(".clawpipe"),
        description="Project home holding captures/, lake/, mlflow.db, prefect/ and models/.",
    )
    proxy_secret: str | None = Field(
        default=None,
        description="HMAC secret for rollout keys; generated once and stored in <home>/secret when unset.",
    )
    admin_token: str | None = Field(
        default=None,
        description="Token for the admin endpoints of the proxy and serving engine; "
        "stored in <home>/admin_token when unset.",
    )
    torch_threads: int = Field(
        default=1, ge=1, description="torch intra-op threads on CPU (1 is fastest on small shared machines)."
    )
    mlflow_tracking_uri: str | None = Field(
        default=None, description="MLflow tracking URI; default sqlite:///<home>/mlflow.db (absolute)."
    )
    inject_faults: str = Field(
        default="",
        description="Testing only: comma-separated stage@iteration (e.g. land_batch@0) that fail once after "
        "doing (part of) their work, to prove retries leave exactly-once data.",
    )
    lake_uri: str | None = Field(
        default=None, description="Lake root: a local path or a pyarrow/fsspec URL; default <home>/lake."
    )
    host_slots: int | None = Field(
        default=None,
        ge=1,
        description="Sandboxes at once on this worker host, over every run (the Prefect global concurrency limit "
        "sandboxes-<host>, created with this many slots if absent); default the host's CPU count.",
    )
    sandbox_ro_roots: str = Field(
        default="",
        description="Host folders (separated by ':') under which a harness manifest's sandbox.ro_paths may bind, "
        "besides the repository holding its harnesses/ folder; never the home or one of its parents.",
    )
    sandbox_uid_base: int = Field(
        default=1_100_000,
        description="First host uid (and gid) of the range sandboxes run as, one uid per running sandbox so the "
        "kernel's per-uid budgets (inotify, message queues, processes) are per sandbox; must not hold real users.",
    )
    sandbox_uid_count: int = Field(
        default=4096, description="How many uids the sandbox range holds (at least the sandboxes run at once)."
    )
    sandbox_uid_locks: Path | None = Field(
        default=None,
        description="Folder of the per-uid lock files that runners on one host allocate sandbox uids through; "
        "default /run/clawpipe/sandbox-uids as root.",
    )
    unsafe_process_checks: bool = Field(
        default=False,
        description="Let the process backend (no isolation) run the checks of task sets whose verifier executes "
        "work-dir code (fixit) as the runner's own user on this host. Only for fully trusted models and harnesses.",
    )
    verify_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Seconds a task set's verifier may run on the host for one rollout; past it the rollout is an "
        "infra error naming this limit and the batch goes on (its thread is left behind, never waited for).",
    )
    reload_roots: str = Field(
        default="",
        description="Directories the serving engine's /admin/reload may load from (os.pathsep-separated, '*' "
        "matches one folder); default <home>/models and <home>/runs/*/checkpoints.",
    )
    # read where they are used (the lake's lease, the train step, the object store, capture upload); declared
    # here so that a bad value is refused, naming the variable, when a command starts
    lake_lease_ttl: float = Field(
        default=60.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds a lake writer's lease lives unrenewed: how long a dead writer blocks the lake "
        "(at least 1).",
    )
    train_process: Literal["", "step"] = Field(
        default="", description="'step': launch a `clawpipe train` process per training step."
    )
    host_id: str | None = Field(
        default=None,
        description="This capture host's name in the object store (letters, digits, '.', '_', '-'); default the "
        "hostname and a hash of the capture folder.",
    )
    capture_upload: Literal["", "0", "1"] = Field(
        default="", description="'0': never upload captures, even with an object-store lake."
    )
    capture_cache: Path | None = Field(
        default=None,
        description="Folder of the local mirrors of object-store capture prefixes; default the temp folder.",
    )

    @field_validator("host_id", "lake_lease_ttl", "capture_cache", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object, info: ValidationInfo) -> object:
        # where these are used an empty value means unset (the default), as it does here
        if isinstance(value, str) and not value.strip():
            return cls.model_fields[str(info.field_name)].default
        return value

    @field_validator("host_id")
    @classmethod
    def _host_id_is_a_name(cls, value: str | None) -> str | None:
        from clawpipe.objstore import HOST_ID_RULE, valid_host_id  # the store's own rule for its key component

        if value is not None:
            value = value.strip()
            if not valid_host_id(value):
                raise ValueError(f"{HOST_ID_RULE} (got {value!r})")
        return value

    @field_validator("home")
    @classmethod
    def _home_is_a_folder(cls, value: Path) -> Path:
        # a file here would surface much later as NotADirectoryError from whichever room first writes
        if value.expanduser().exists() and not value.expanduser().is_dir():
            raise ValueError(f"{str(value)!r} is a file, not a folder; point CLAWPIPE_HOME at a folder")
        return value

    @property
    def root(self) -> Path:
        return self.home.expanduser().resolve()

    @property
    def captures_dir(self) -> Path:
        return self.root / "captures"

    @property
    def lake_dir(self) -> str:
        return self.lake_uri or str(self.root / "lake")

    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    @property
    def prefect_home(self) -> Path:
        return self.root / "prefect"

    @property
    def runs_dir(self) -> Path:
        return self.root / "runs"

    @property
    def tracking_uri(self) -> str:
        return self.mlflow_tracking_uri or f"sqlite:///{self.root / 'mlflow.db'}"

    def secret(self) -> bytes:
        """The proxy's HMAC secret, created with 0600 permissions on first use."""
        if self.proxy_secret:
            return self.proxy_secret.encode()
        return _stored_token(self.root / "secret").encode()

    def admin(self) -> str:
        """The admin token shared by the proxy and the serving engine."""
        return self.admin_token or _stored_token(self.root / "admin_token")


def _stored_token(path: Path) -> str:
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    try:
        os.link(tmp, path)  # first writer wins; a racing process reads the winner's token
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()


@functools.lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The settings of this process; a ConfigError naming each bad ``CLAWPIPE_*`` variable otherwise."""
    try:
        return Settings()
    except ValidationError as exc:
        raise ConfigError(_describe_env(exc)) from None


def _describe_env(exc: ValidationError) -> str:
    """One line naming each environment variable whose value was refused, the value and why."""
    from clawpipe.configfile import shown

    parts = []
    for err in exc.errors():
        name = "CLAWPIPE_" + "_".join(str(x) for x in err["loc"]).upper()
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] != "value_error":
            msg += f" (got {shown(err.get('input'))})"
        parts.append(f"{name}: {msg}")
    return "invalid environment: " + "; ".join(parts) + "; fix or unset these variables"


def prepare_environment(settings: Settings | None = None) -> Settings:
    """Set offline-safe Prefect/MLflow variables (docs/ARCHITECTURE.md, pitfalls) unless the user set them already."""
    s = settings or get_settings()
    defaults = {
        "PREFECT_HOME": str(s.prefect_home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "true",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
        "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
        "MLFLOW_TRACKING_URI": s.tracking_uri,
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    s.root.mkdir(parents=True, exist_ok=True)
    return s
