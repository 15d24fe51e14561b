"""What the runner checks before any sandbox starts, so that a bad batch fails whole and at once.

:func:`check_specs` loads each spec's harness manifest and validates its task, the manifest's read-only
paths and task sets, and the run and rollout ids (no two rollouts of one iteration may share an id: their
rows and folders would collide). :func:`check_proxy` makes sure something listens at the proxy's address.
clawpipe/sandbox/runner.py calls both before it starts the batch.
"""

from __future__ import annotations

import socket
from pathlib import Path

from clawpipe.errors import ConfigError, ManifestError, SandboxError
from clawpipe.sandbox.bridge import parse_proxy_url
from clawpipe.sandbox.manifest import HarnessManifest, find_harness, validate_task
from clawpipe.sandbox.rollout import RolloutSpec


def check_specs(specs: list[RolloutSpec], harness_dirs: list[Path] | None) -> dict[int, HarnessManifest]:
    """Validate every spec (manifest, task, ids) before anything runs; return the manifest per spec index."""
    cache: dict[str, HarnessManifest] = {}
    out: dict[int, HarnessManifest] = {}
    seen: set[tuple[str, int, str]] = set()
    for i, spec in enumerate(specs):
        if isinstance(spec.harness, HarnessManifest):
            manifest = spec.harness
        else:
            if spec.harness not in cache:
                cache[spec.harness] = find_harness(spec.harness, harness_dirs)
            manifest = cache[spec.harness]
        validate_task(spec.task, f"rollout {i} task")
        for ro in manifest.ro_paths:
            if not ro.exists():
                raise ManifestError(
                    f"harness {manifest.name!r} needs {ro} (sandbox.ro_paths) but it does not exist; install it first"
                )
        if manifest.task_sets and spec.task["task_set"] not in manifest.task_sets:
            raise ManifestError(
                f"harness {manifest.name!r} supports task sets {list(manifest.task_sets)}, "
                f"not {spec.task['task_set']!r} (add it to task_sets in its harness.toml)"
            )
        for name, value in (("run_id", spec.run_id), ("rollout_id", spec.id)):
            if not value or "/" in value or "\x1f" in value or value.startswith("."):
                raise ConfigError(f"rollout {i}: {name}={value!r} must be non-empty, without '/', not start with '.'")
        ident = (spec.run_id, spec.iteration, spec.id)
        if ident in seen:
            raise ConfigError(
                f"rollout {i}: duplicate rollout id {spec.id!r} in run {spec.run_id} iteration {spec.iteration}"
            )
        seen.add(ident)
        out[i] = manifest
    return out


def check_proxy(proxy_url: str, timeout_s: float = 3.0) -> None:
    """Fail fast, before any sandbox starts, when nothing listens at the proxy's address."""
    host, port = parse_proxy_url(proxy_url)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise SandboxError(
            f"nothing answers at the proxy {proxy_url} ({exc}); start it first (clawpipe proxy --upstream URL)"
        ) from exc
