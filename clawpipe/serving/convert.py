"""Request translation: OpenAI Chat, OpenAI Responses and Anthropic Messages bodies -> chat-template messages
(clawpipe.apis.requests), tools and sampling parameters. Everything a harness sends that the engine cannot
honour (cache_control, thinking, beta features, metadata, include, ...) is accepted and ignored; malformed
input raises RequestError with a message naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from clawpipe.apis import requests
from clawpipe.errors import RequestShapeError
from clawpipe.serving.params import RequestError, SamplingParams

T = TypeVar("T")


def apply_tool_choice(body: dict[str, Any], tools: list[dict[str, Any]], api: str) -> list[dict[str, Any]]:
    """The tools to offer under the request's tool_choice (api: chat, responses or anthropic).

    none: no tools (not rendered, and the output is not parsed for calls). auto, required / any, or one named
    tool: the same tools; the engine has no constrained decoding, so required and named choices are checked
    (the name must be one of the tools) but not enforced; vLLM enforces them."""
    choice = body.get("tool_choice")
    if choice is None:
        return tools
    name: Any = None
    if api == "anthropic":
        kinds = ("auto", "any", "tool", "none")
        if not isinstance(choice, dict) or choice.get("type") not in kinds:
            raise RequestError("'tool_choice' must be {type: auto | any | tool | none} (tool also needs 'name')")
        kind = choice["type"]
        if kind == "tool":
            name = choice.get("name")
    elif isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise RequestError(f"'tool_choice' must be none, auto, required or a function, got {choice!r}")
        kind = choice
    elif isinstance(choice, dict) and choice.get("type") == "function":
        kind = "function"
        name = (choice.get("function") or {}).get("name") if api == "chat" else choice.get("name")
    elif isinstance(choice, dict) and api == "responses":
        kind = "auto"  # allowed_tools, hosted tool types: nothing to check here
    else:
        raise RequestError("'tool_choice' must be none, auto, required or {type: 'function', ...} naming a tool")
    if kind == "none":
        return []
    names = sorted(t["function"]["name"] for t in tools)
    if kind in ("required", "any", "tool", "function") and not tools:
        raise RequestError(f"tool_choice {json.dumps(choice)} needs at least one tool in 'tools'")
    if kind in ("tool", "function") and (not isinstance(name, str) or name not in names):
        raise RequestError(f"tool_choice names {name!r}, which is not one of the request's tools {names}")
    return tools


def stop_list(value: Any, key: str = "stop") -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise RequestError(f"'{key}' must be a string or a list of strings")


# fields several APIs share, by the JSON type they must have when present (null counts as absent)
COMMON_TYPES: dict[str, tuple[type, str]] = {
    "model": (str, "a string"),
    "stream": (bool, "true or false"),
    "stream_options": (dict, "an object"),
    "return_token_ids": (bool, "true or false"),
    "metadata": (dict, "an object"),
    "parallel_tool_calls": (bool, "true or false"),
    "ignore_eos": (bool, "true or false"),
}


def check_common(body: dict[str, Any]) -> None:
    """RequestError when a shared field has the wrong JSON type (e.g. "stream": "false", a string)."""
    for key, (kind, what) in COMMON_TYPES.items():
        value = body.get(key)
        if value is not None and not isinstance(value, kind):
            raise RequestError(f"'{key}' must be {what}, got {json.dumps(value)[:80]}")


def _number(body: dict[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"'{key}' must be a number")
    return float(value)


def int_field(body: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestError(f"'{key}' must be an integer")
        return value
    return None


def sampling(
    body: dict[str, Any], max_tokens: int | None, default_max: int, stop: list[str], n: int = 1, top_logprobs: int = 0
) -> SamplingParams:
    """SamplingParams from common fields (temperature, top_p, seed) and the API-specific ones passed in."""
    return SamplingParams(
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        max_tokens=max_tokens if max_tokens is not None else default_max,
        stop=stop,
        seed=int_field(body, "seed"),
        n=n,
        stream=bool(body.get("stream")),
        top_logprobs=top_logprobs,
        ignore_eos=bool(body.get("ignore_eos")),
    )


# ---------------------------------------------------------------- request bodies as template messages
# The conversion lives in clawpipe.apis.requests (the proxy's retokenizer renders requests the same way);
# here its shape errors become the engine's 400s.


def _served(convert: Callable[[dict[str, Any]], T], body: dict[str, Any]) -> T:
    try:
        return convert(body)
    except RequestShapeError as exc:
        raise RequestError(str(exc)) from exc


def chat_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(template messages, template tools) of a chat-completions body."""
    return _served(requests.chat_messages, body)


def input_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A Responses body's input as a list of items (a string is one user message)."""
    return _served(requests.input_items, body)


def responses_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(template messages, template tools) of a Responses body (instructions, input items, function tools)."""
    return _served(requests.responses_messages, body)


def anthropic_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(template messages, template tools) of an Anthropic Messages body, as Claude Code sends it."""
    return _served(requests.anthropic_messages, body)
