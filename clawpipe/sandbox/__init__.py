"""Sandboxed rollouts: run unmodified harness programs in isolation, many at once, against the proxy.

Public API: :func:`run_rollouts` / :func:`iter_rollouts` with :class:`RolloutSpec` -> :class:`RolloutResult`,
:func:`masked_groups`, and the manifest helpers :func:`load_manifest`, :func:`find_harness`,
:func:`list_harnesses`, :func:`load_task_file`. Backends live in clawpipe.sandbox.backends.
"""

from clawpipe.sandbox.limits import Limits
from clawpipe.sandbox.manifest import (
    HarnessManifest,
    find_harness,
    list_harnesses,
    load_manifest,
    load_task_file,
    validate_task,
)
from clawpipe.sandbox.rollout import RolloutResult, RolloutSpec, masked_groups
from clawpipe.sandbox.runner import iter_rollouts, run_rollouts

__all__ = [
    "HarnessManifest",
    "Limits",
    "RolloutResult",
    "RolloutSpec",
    "find_harness",
    "iter_rollouts",
    "list_harnesses",
    "load_manifest",
    "load_task_file",
    "masked_groups",
    "run_rollouts",
    "validate_task",
]
