"""The error hierarchy. Every message says what went wrong and what to do about it."""

from __future__ import annotations


class ClawpipeError(Exception):
    """Base of every error clawpipe raises on purpose."""


class Halted(BaseException):
    """Work in a worker thread stopped because its run is stopping (cancelled or killed): like the signal
    that stops the main thread, not a failure of the work, and nothing to retry; ``--resume`` goes on."""


class ConfigError(ClawpipeError, ValueError):
    """A setting, config file or manifest is invalid; the message names the field and what is allowed."""


class ManifestError(ConfigError):
    """A harness manifest or task file is malformed."""


class CaptureError(ClawpipeError):
    """A capture segment is unreadable beyond what torn-tail recovery can repair."""


class CaptureHeaderError(CaptureError, ValueError):
    """A capture record's header does not fit :class:`clawpipe.capture.CaptureHeader`; the message names the
    field. One such record is rejected; the records around it land."""


class KeyVerificationError(ClawpipeError):
    """A rollout key is missing, malformed or forged."""


class SandboxError(ClawpipeError):
    """A sandbox could not be set up (missing tool, no permissions); infra, not the harness's fault."""


class VerifierTimeoutError(ClawpipeError):
    """A task set's verifier did not return within the host's time limit for verification."""


class LakeError(ClawpipeError):
    """The lake is missing, unreadable, or a query against it failed."""


class TreeError(ClawpipeError):
    """Tree reconstruction met data it cannot represent."""


class TrainingError(ClawpipeError):
    """Training input is unusable (no generated tokens, NaN rewards, a policy that does not load)."""


class ServingError(ClawpipeError):
    """The serving engine could not load a model or serve a request."""


class RequestShapeError(ClawpipeError, ValueError):
    """A request body does not have the shape its API promises; the message names the field to fix."""
