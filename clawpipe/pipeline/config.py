"""Run settings of one pipeline run: validated, loadable from TOML, overridable from the CLI, logged whole.

An invalid config fails before anything starts, naming the field, the bad value and what is allowed. Values
keep the type TOML gives them (``groups = "4"`` or ``groups = 2.0`` is refused, not converted), floats must
be finite, and counts are bounded so that one iteration's rollouts fit in memory.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from clawpipe.configfile import describe, read_values, shown, validate
from clawpipe.errors import ConfigError

_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*")  # a DNS name
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # fullmatch: "$" would let a trailing newline through
# One iteration's rollouts (train and evaluation, over every harness) are planned in memory at once, a few KB
# each: this bound turns a mistyped count (groups = 1000000000) into an error before anything starts.
MAX_ROLLOUTS_PER_ITERATION = 100_000
_WEEK_S = 7 * 24 * 3600.0
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
# The table of a run's config.toml artifact that records what the run used (clawpipe/pipeline/provenance.py):
# not a setting, so loading the file leaves it out, and the file runs again unchanged.
RECORDED_TABLE = "recorded"


class HarnessEntry(BaseModel):
    """One harness trained through in this run, with the task set it plays."""

    model_config = _STRICT

    name: str = Field(description="Harness folder name under harnesses/ (e.g. chat-loop).")
    task_set: str = Field(description="Task set the harness plays (e.g. guess, calc, fixit).")
    weight: float = Field(default=1.0, gt=0, description="Loss weight of this harness's rollouts.")
    groups: int | None = Field(
        default=None, ge=1, description="Groups per iteration for this harness; default run.groups."
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment for this harness in this run, set over its harness.toml [env] (e.g. "
        '{CLAWPIPE_CLI_MODE = "full"} for a real CLI harness).',
    )

    @field_validator("name")
    @classmethod
    def _folder_name(cls, v: str) -> str:
        # a name, not a path: the run's harnesses are the repository's, found the same way on every rollout host
        if not _NAME.fullmatch(v) or v.endswith(".toml"):
            raise ValueError(
                f"{shown(v, 40)} is not a harness folder name; use the name of a folder under harnesses/ "
                "(1-64 letters, digits, '.', '_' or '-', starting with a letter or digit; no paths)"
            )
        return v

    @field_validator("env")
    @classmethod
    def _check_env(cls, v: dict[str, str]) -> dict[str, str]:
        from clawpipe.sandbox.manifest import check_env

        for k, value in v.items():
            if "\0" in value:  # exec refuses it, so every rollout would fail at its start
                raise ValueError(f"{k} holds a NUL character, which no process environment can carry; remove it")
        return check_env(v, "env")


class PipelineConfig(BaseModel):
    """One pipeline run: rollout -> land -> reconstruct -> train -> publish, for N iterations."""

    model_config = _STRICT

    run_name: str = Field(default="default", description="Human name; the run_id adds a timestamp to it.")
    experiment: str = Field(default="clawpipe", description="MLflow experiment the run is logged to.")
    iterations: int = Field(default=10, ge=1, le=10_000, description="Training iterations.")
    harnesses: list[HarnessEntry] = Field(
        default_factory=lambda: [
            HarnessEntry(name="chat-loop", task_set="guess"),
            HarnessEntry(name="compacting-agent", task_set="guess"),
        ],
        min_length=1,
        description="Harnesses trained through at once (mix-harness).",
    )
    groups: int = Field(default=4, ge=1, description="GRPO groups (distinct tasks) per harness per iteration.")
    samples: int = Field(default=4, ge=1, description="Rollouts per group (the GRPO group size).")
    eval_tasks: int = Field(
        default=4, ge=0, description="Held-out tasks per harness evaluated each evaluation iteration."
    )
    eval_samples: int = Field(
        default=4,
        ge=0,
        description="Rollouts per held-out task at the sampling temperature, beside one greedy rollout: their "
        "mean shows learning long before greedy decoding of a small policy does.",
    )
    eval_every: int = Field(default=10, ge=1, description="Evaluate every N iterations (and after the last).")
    mode: Literal["sync", "async"] = Field(
        default="sync",
        description="sync: each iteration rolls out, then trains. async: a rollout producer keeps rolling out "
        "against the current policy while the trainer takes each landed batch (flows/async_loop.py).",
    )
    max_staleness: int = Field(
        default=1,
        ge=0,
        le=64,
        description="async: the oldest trained call is this many policy versions behind the policy being "
        "trained; older calls are dropped and counted. The producer runs at most max(1, max_staleness) batches "
        "ahead of the trainer.",
    )
    seed: int = Field(default=0, ge=0, le=2**32 - 1, description="Seed of task sampling and the default policy.")
    backend: Literal["bwrap", "docker", "process"] = Field(default="bwrap", description="Sandbox backend.")
    concurrency: int = Field(default=8, ge=1, le=1024, description="Sandboxes running at once (global limit).")
    policy: str | None = Field(
        default=None, description="Initial policy directory; default: the tiny policy built under <home>/models."
    )
    policy_size: Literal["tiny", "small"] = Field(default="tiny", description="Size of the default policy.")
    engine: Literal["local", "vllm"] = Field(default="local", description="Serving engine.")
    served_name: str = Field(default="clawpipe-policy", description="Model name harnesses ask for.")
    rollout_timeout_s: float | None = Field(
        default=None, gt=0, le=_WEEK_S, description="Override of each manifest's timeout."
    )
    rollout_pool: str | None = Field(
        default=None,
        description="Prefect work pool to fan rollouts out to: each batch is split into shards of shard_size, each "
        "a flow run of the rollout-shard deployment on this pool (workers: clawpipe worker --pool NAME). Needs a "
        "Prefect server (PREFECT_API_URL) and an object-store lake (CLAWPIPE_LAKE_URI). Default: in process.",
    )
    serve_host: str = Field(
        default="127.0.0.1",
        description="Address the run's policy server binds; worker hosts of a rollout_pool reach it there "
        "(0.0.0.0: every interface, reached by this host's name).",
    )
    shard_size: int = Field(default=16, ge=1, le=100_000, description="Rollouts per shard (with rollout_pool).")
    shard_timeout_s: float = Field(
        default=3600.0,
        gt=0,
        le=_WEEK_S,
        description="A shard not finished this long after submission is given up and rerun.",
    )
    shard_start_s: float = Field(
        default=300.0,
        ge=5,
        le=_WEEK_S,
        description="A shard taken by a worker whose heartbeat has not appeared this long after (its worker died "
        "while starting it) is given up and rerun.",
    )
    shard_stall_s: float = Field(
        default=60.0,
        ge=5,
        le=_WEEK_S,
        description="A running shard whose heartbeat (in the lake, every quarter of this) stops this long is taken "
        "for dead (its worker killed) and its rollouts rerun elsewhere under new ids.",
    )
    train: dict[str, Any] = Field(
        # Tuned for the tiny policy on CPU: a high learning rate, six optimizer epochs per batch (a step of
        # the tiny policy takes seconds in the run's training process, so epochs are cheap next to rollouts),
        # and NO entropy bonus: the untrained policy is near uniform (entropy 6.2 of ln 512 = 6.24), so a bonus
        # (0.02) held it there and the reward wandered; without it the entropy falls steadily. At 0.006 the
        # train reward's mean of the last 3 iterations ended at 0.16-0.23 over 10 iterations, under 3x the
        # first iteration's when that one drew high (0.06); 0.01 ends at 0.21-0.27 (six runs, two seeds).
        default_factory=lambda: {"learning_rate": 0.01, "entropy_coef": 0.0, "epochs": 6},
        description="Trainer settings (clawpipe.train TrainConfig fields), validated before the run starts.",
    )

    @field_validator("run_name", "experiment", "served_name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not _NAME.fullmatch(v):
            raise ValueError(
                f"{shown(v, 40)}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        return v

    @field_validator("serve_host")
    @classmethod
    def _host(cls, v: str) -> str:
        import ipaddress

        try:
            ipaddress.ip_address(v)
        except ValueError:
            if len(v) > 253 or not _HOST.fullmatch(v):
                raise ValueError(
                    f"{shown(v, 40)} is neither an IP address nor a host name; give e.g. 127.0.0.1 or 0.0.0.0"
                ) from None
        return v

    @field_validator("train")
    @classmethod
    def _finite_train(cls, v: dict[str, Any]) -> dict[str, Any]:
        for k, value in v.items():
            items = value if isinstance(value, list) else [value]  # e.g. betas = [0.9, 0.999]
            if any(isinstance(x, float) and not math.isfinite(x) for x in items):
                raise ValueError(f"{k} = {value} is not finite; give finite numbers")
        return v

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        seen: set[tuple[str, str]] = set()
        for h in self.harnesses:
            if (h.name, h.task_set) in seen:
                raise ValueError(
                    f"harnesses: {h.name} with task set {h.task_set} appears twice; list each (name, task_set) pair "
                    "once, with one groups, weight and env"
                )
            seen.add((h.name, h.task_set))
        if self.samples < 2:
            raise ValueError("samples: GRPO needs at least 2 rollouts per group to compare")
        planned = self.rollouts_per_iteration()
        if planned > MAX_ROLLOUTS_PER_ITERATION:
            raise ValueError(
                f"groups x samples (+ eval_tasks x (1 + eval_samples)) over {len(self.harnesses)} harness(es) plans "
                f"{planned:,} rollouts per iteration, over the {MAX_ROLLOUTS_PER_ITERATION:,} one iteration may "
                "hold; lower groups, samples, eval_tasks or eval_samples, or spread them over more iterations"
            )
        return self

    def rollouts_per_iteration(self) -> int:
        """Rollouts of one iteration that evaluates: every harness's groups x samples plus its held-out tasks."""
        train = sum((h.groups or self.groups) * self.samples for h in self.harnesses)
        return train + len(self.harnesses) * self.eval_tasks * (1 + self.eval_samples)

    def train_config(self) -> Any:
        """The trainer's validated config (imports clawpipe.train.config: pydantic only, no torch)."""
        from clawpipe.train.config import TrainConfig

        return TrainConfig.model_validate(self.train)


def load_config(path: str | Path | None = None, **overrides: Any) -> PipelineConfig:
    """Load a TOML (or JSON) config, or the defaults, and apply CLI overrides (None values are ignored)."""
    data = read_values(path, what="config file") if path is not None else {}
    if isinstance(data.get(RECORDED_TABLE), dict):
        del data[RECORDED_TABLE]
    source = str(path) if path is not None else "defaults"
    data.update({k: v for k, v in overrides.items() if v is not None})
    from clawpipe.train.config import TrainConfig

    cfg = validate(PipelineConfig, data, what=f"pipeline config ({source})", tables={"train": TrainConfig})

    try:
        cfg.train_config()
    except ValidationError as exc:
        raise ConfigError(describe(exc, f"pipeline config ({source}, table train)", TrainConfig)) from None
    return cfg
