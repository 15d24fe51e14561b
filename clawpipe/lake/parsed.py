"""What parsing a captured response gives: :class:`ParsedCall` (one call's columns before the row layout)
and its :class:`Choice` rows, :class:`ParseError`, and the tool-call shape every API's calls are turned into."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ParseError(ValueError):
    """The response does not have the shape its API promises."""


@dataclass(slots=True)
class Choice:
    index: int
    token_ids: list[int] | None = None
    # vLLM's /v1/completions puts each prompt's ids in its choices (and stream chunks' choices), not at the
    # top level; a choice's own prompt ids win over the response's
    prompt_token_ids: Any = None
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


@dataclass(slots=True)
class ParsedCall:
    response: bytes | memoryview | None = None  # JSON as UTF-8 (raw body, or the reassembled stream)
    prompt_token_ids: list[int] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None  # call total from usage
    spliced_tokens: int | None = None  # prompt ids the engine carried over from the rollout's earlier completions
    policy_version: int | None = None
    model: str | None = None
    error: str | None = None
    choices: list[Choice] = field(default_factory=list)
    # id and logprob lists came from the typed decoder: their element types are checked already
    typed: bool = field(default=False, compare=False)
    # the stream ended in an error (its last event is the API's error event, or a failed response)
    stream_error: bool = False


def drop_echoed_prompts(
    choices: list[Choice], prompt: Any, usage_prompt: int | None, usage_completion: int | None
) -> None:
    """Keep only the completion's logprobs of each completions choice whose request set ``echo``.

    vLLM echoes the prompt into the text and into the logprobs: ``token_logprobs`` holds the prompt's logprobs
    first (the first of them null), then the sampled tokens', while ``token_ids`` holds the sampled ids only.
    Left whole, the list is one a trainer would read as the sampling logprobs of the completion's ids. A
    list exactly as long as the prompt (the choice's own, else ``prompt``) and the completion together is
    cut to its last part; without ids (no ``return_token_ids``) the lengths come from the usage, which
    counts one choice's tokens only when there is one choice.
    """
    if len(choices) != 1:
        usage_prompt = usage_completion = None
    for choice in choices:
        lps = choice.logprobs
        if not lps:
            continue
        own = choice.prompt_token_ids if choice.prompt_token_ids is not None else prompt
        if choice.token_ids is not None and own is not None:
            n_prompt, n_completion = len(own), len(choice.token_ids)
        elif usage_prompt is not None and usage_completion is not None:
            n_prompt, n_completion = usage_prompt, usage_completion
        else:
            continue
        if n_prompt > 0 and len(lps) == n_prompt + n_completion:
            choice.logprobs = list(lps[n_prompt:])


def chat_tool_calls(msg: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Tool calls in the OpenAI chat shape (``function.arguments`` a string), from a chat message."""
    tcs = msg.get("tool_calls")
    if not tcs:
        return None
    return [
        {
            "id": tc.get("id"),
            "type": tc.get("type") or "function",
            "function": {
                "name": (tc.get("function") or {}).get("name"),
                "arguments": (tc.get("function") or {}).get("arguments") or "",
            },
        }
        for tc in tcs
    ]
