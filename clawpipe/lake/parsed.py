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
    response: bytes | None = None  # JSON as UTF-8 bytes (raw body, or the reassembled stream)
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
