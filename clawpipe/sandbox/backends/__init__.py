"""Sandbox backends: bwrap (default), docker, process. Pick one with :func:`get_backend`."""

from clawpipe.sandbox.backends.base import BACKENDS, Backend, Outcome, PythonEnv, SandboxJob, get_backend

__all__ = ["BACKENDS", "Backend", "Outcome", "PythonEnv", "SandboxJob", "get_backend"]
