"""What a request asks the engine for and what it gets back: sampling parameters, token events, and the
errors a request can end with."""

from __future__ import annotations

from dataclasses import dataclass, field

from clawpipe.errors import ServingError

SHUTTING_DOWN = "the server is shutting down; retry against a running one"


class ShuttingDown(ServingError):
    """The server is stopping: the request was not, or not fully, served (HTTP 503; retry elsewhere)."""


class RequestError(ServingError, ValueError):
    """A request the engine cannot serve as asked (HTTP 400 unless `status` says otherwise); the message says
    what to change, `param` and `code` fill the fields of the same name in an OpenAI error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


@dataclass
class SamplingParams:
    """Per-request decoding settings."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    stream: bool = False  # decode text per token (else once at the end, unless stop strings need it)
    top_logprobs: int = 0  # also report this many most likely tokens per position (with their logprobs)
    ignore_eos: bool = False  # keep generating past EOS until max_tokens or a stop string (vLLM's extra field)


@dataclass
class TokenEvent:
    """One generated token of one choice, or its end (`finish_reason` set; token fields may be None)."""

    index: int
    token_id: int | None
    logprob: float | None
    text: str
    finish_reason: str | None = None
    stopped_on: str | None = None  # the stop string that ended the choice, if one did
    top: list[tuple[int, float]] | None = None  # (id, logprob) of the most likely tokens, when asked for
