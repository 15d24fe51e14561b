"""What a request asks the engine for and what it gets back: sampling parameters, token events, and the
errors a request can end with."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

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
    # what the sampled distribution may differ by (see clawpipe.serving.sampler.Shaping); neutral by default
    top_k: int = 0  # 0 (or vLLM's -1): every id
    min_p: float = 0.0
    min_tokens: int = 0  # no EOS before this many tokens (stop strings still end a choice)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    forced: list[int] = field(default_factory=list)  # the first ids, given (a tool_choice's call opening)
    stop_token_ids: list[int] = field(default_factory=list)  # ids that end a choice, as EOS does (vLLM's field)

    @property
    def shaped(self) -> bool:
        """Whether anything but temperature and top-p shapes the distribution sampled from."""
        return bool(
            self.top_k > 0
            or self.min_p > 0
            or self.min_tokens > 0
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.forced
        )


@dataclass
class TokenEvent:
    """One generated token of one choice, or its end (`finish_reason` set; token fields may be None)."""

    index: int
    token_id: int | None
    logprob: float | None
    text: str
    finish_reason: str | None = None
    stopped_on: str | int | None = None  # the stop string (or stop_token_ids id) that ended the choice, if one did
    top: list[tuple[int, float]] | None = None  # (id, logprob) of the most likely tokens, when asked for


@dataclass
class Request:
    """One request in the engine: its prompt and parameters, where its events go, and how far it got."""

    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]
    cancelled: bool = False
    policy_version: int | None = None
    held: list[TokenEvent] = field(default_factory=list)  # non-streamed: events delivered once, at the end
    finished: int = 0

    @property
    def reserve(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens


def check_request(
    prompt_ids: list[int], params: SamplingParams, *, context: int, prompt_limit: int, kv_budget: int, vocab: int
) -> None:
    """Raise RequestError when a request can never be served: its prompt against the context and the prompt
    limit, max_tokens against the context, n x (prompt + max_tokens) against the KV budget, then its values."""
    n_prompt = len(prompt_ids)
    if n_prompt == 0:
        raise RequestError("the prompt is empty: send at least one message or prompt token")
    if n_prompt >= context:
        raise RequestError(
            f"context overflow: the prompt has {n_prompt} tokens but the model's context is {context}; "
            "shorten the conversation"
        )
    if n_prompt > prompt_limit:
        raise RequestError(
            f"the prompt has {n_prompt} tokens, more than this server's limit of {prompt_limit} prompt "
            "tokens per request; shorten the conversation (the operator sets the limit with --max-prompt-tokens)"
        )
    if params.max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {params.max_tokens}")
    if n_prompt + params.max_tokens > context:
        raise RequestError(
            f"max_tokens={params.max_tokens} is beyond the limit: prompt ({n_prompt} tokens) + max_tokens must be "
            f"<= {context} (the context length); ask for at most {context - n_prompt}"
        )
    if params.n * (n_prompt + params.max_tokens) > kv_budget:
        raise RequestError(
            f"n x (prompt + max_tokens) = {params.n * (n_prompt + params.max_tokens)} tokens exceeds the KV budget "
            f"of {kv_budget} tokens; lower max_tokens or n, or raise --kv-budget-tokens"
        )
    if not 0 <= params.temperature <= 100:
        raise RequestError(f"temperature must be in [0, 100], got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {params.top_p}")
    if not 1 <= params.n <= 128:
        raise RequestError(f"n must be in [1, 128], got {params.n}")
    if not 0 <= params.top_logprobs <= 20:
        raise RequestError(f"top_logprobs must be in [0, 20], got {params.top_logprobs}", param="top_logprobs")
    check_shaping(params)
    if any(not 0 <= t < vocab for t in prompt_ids):
        raise RequestError(f"prompt token ids must be in [0, {vocab})")
    if any(not 0 <= t < vocab for t in params.stop_token_ids):
        raise RequestError(f"stop_token_ids must be in [0, {vocab})", param="stop_token_ids")


def check_text_length(chars: int, longest_piece: int, *, context: int, prompt_limit: int) -> None:
    """Raise RequestError when `chars` characters of prompt text are too many tokens whatever they tokenize to.

    No token covers more characters than the tokenizer's longest piece, so the text is at least chars /
    longest_piece tokens; refusing it before tokenizing keeps an oversized prompt from costing the tokenizer
    ~80 bytes of memory per character (a 300 MB body took 24 GB)."""
    floor = chars // max(1, longest_piece)
    if floor >= context:
        raise RequestError(
            f"context overflow: the prompt has at least {floor} tokens but the model's context is {context}; "
            "shorten the conversation"
        )
    if floor > prompt_limit:
        raise RequestError(
            f"the prompt has at least {floor} tokens, more than this server's limit of {prompt_limit} prompt "
            "tokens per request; shorten the conversation (the operator sets the limit with --max-prompt-tokens)"
        )


def check_shaping(params: SamplingParams) -> None:
    """RequestError naming the field when a distribution-shaping value is out of its range (vLLM's ranges)."""
    if params.top_k < 0:
        raise RequestError(f"top_k must be -1 or 0 (every token) or >= 1, got {params.top_k}", param="top_k")
    if not 0 <= params.min_p <= 1:
        raise RequestError(f"min_p must be in [0, 1], got {params.min_p}", param="min_p")
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise RequestError(
            f"min_tokens must be in [0, max_tokens = {params.max_tokens}], got {params.min_tokens}", param="min_tokens"
        )
    for key in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, key)
        if not -2 <= value <= 2:
            raise RequestError(f"'{key}' must be in [-2, 2], got {value}", param=key)
    if not 0 < params.repetition_penalty <= 2:
        raise RequestError(
            f"repetition_penalty must be in (0, 2], got {params.repetition_penalty}", param="repetition_penalty"
        )
