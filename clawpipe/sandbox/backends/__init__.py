"""Sandbox backends: bwrap (default), docker, process. Pick one with :func:`get_backend`.

The factory lives here, above the backends, so that ``base`` (what every backend shares) never imports a
backend and no module of the package imports one that imports it back.
"""

from __future__ import annotations

from clawpipe.errors import ConfigError
from clawpipe.sandbox.backends.base import BACKENDS, Backend, Outcome, PythonEnv, SandboxJob


def get_backend(name: str, **options: object) -> Backend:
    """Construct a backend by name: bwrap (default), docker, process (imported only when chosen)."""
    if name == "bwrap":
        from clawpipe.sandbox.backends.bwrap import BwrapBackend

        return BwrapBackend(**options)  # type: ignore[arg-type]
    if name == "process":
        from clawpipe.sandbox.backends.process import ProcessBackend

        return ProcessBackend(**options)  # type: ignore[arg-type]
    if name == "docker":
        from clawpipe.sandbox.backends.docker import DockerBackend

        return DockerBackend(**options)  # type: ignore[arg-type]
    raise ConfigError(f"unknown sandbox backend {name!r}; choose one of {list(BACKENDS)}")


__all__ = ["BACKENDS", "Backend", "Outcome", "PythonEnv", "SandboxJob", "get_backend"]
