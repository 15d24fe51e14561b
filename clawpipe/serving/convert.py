"""Request translation: OpenAI Chat, OpenAI Responses and Anthropic Messages bodies -> chat-template messages
(clawpipe.apis.requests), tools and sampling parameters. Everything a harness sends that the engine cannot
honour (cache_control, thinking, beta features, metadata, include, ...) is accepted and ignored, except content
it cannot read (images, audio, files: a 400, since answering without them would answer another prompt);
malformed input raises RequestError with a message naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from clawpipe.apis import requests
from clawpipe.errors import RequestShapeError
from clawpipe.serving.params import RequestError, SamplingParams
from clawpipe.serving.policy import TOOL_CALL_OPEN
from clawpipe.serving.splice import Ending

T = TypeVar("T")


def apply_tool_choice(body: dict[str, Any], tools: list[dict[str, Any]], api: str) -> list[dict[str, Any]]:
    """The tools to offer under the request's tool_choice (api: chat, responses or anthropic).

    none: no tools (not rendered, and the output is not parsed for calls). auto, required / any, or one named
    tool: the same tools, the name checked to be one of them; `forced_call` says how the answer must begin for
    required and named choices."""
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
        name = _chat_choice_name(choice) if api == "chat" else choice.get("name")
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


def forced_call(body: dict[str, Any], tools: list[dict[str, Any]]) -> str | None:
    """The text a tool_choice already checked by `apply_tool_choice` makes the answer begin with: the opening
    of a call for required / any, that and the tool's name for a named tool (its arguments are then sampled);
    None for auto and none. The engine has no grammar to constrain a whole call to JSON, as vLLM does; forcing
    its start keeps the promise that the answer is a call of that tool, in the chat template's own format."""
    choice = body.get("tool_choice")
    if not tools or choice is None or choice in ("auto", "none"):
        return None
    if choice == "required" or (isinstance(choice, dict) and choice.get("type") == "any"):
        return TOOL_CALL_OPEN
    if not isinstance(choice, dict) or choice.get("type") not in ("tool", "function"):
        return None  # the Responses API's allowed_tools and hosted tool choices: nothing to force
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else choice.get("name")
    return f'{TOOL_CALL_OPEN}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


def _chat_choice_name(choice: dict[str, Any]) -> Any:
    """The tool name of a chat tool_choice {type: 'function', function: {name}}."""
    function = choice.get("function")
    if not isinstance(function, dict):
        raise RequestError(
            "'tool_choice' of type function must be {type: 'function', function: {name: ...}}, got "
            f"{json.dumps(choice)[:80]}",
            param="tool_choice",
        )
    return function.get("name")


# stop strings one request may name: each is searched for after every token, on the engine thread every
# request shares (100,000 of them slowed another client's request 20x)
MAX_STOP_STRINGS = 64


def stop_list(value: Any, key: str = "stop") -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        raise RequestError(f"'{key}' must be a string or a list of strings", param=key)
    if len(value) > MAX_STOP_STRINGS:
        raise RequestError(f"'{key}' has {len(value)} strings; send at most {MAX_STOP_STRINGS}", param=key)
    return list(dict.fromkeys(s for s in value if s))


# fields several APIs share, by the JSON type they must have when present (null counts as absent)
COMMON_TYPES: dict[str, tuple[type, str]] = {
    "model": (str, "a string"),
    "stream": (bool, "true or false"),
    "stream_options": (dict, "an object"),
    "return_token_ids": (bool, "true or false"),
    "metadata": (dict, "an object"),
    "parallel_tool_calls": (bool, "true or false"),
    "ignore_eos": (bool, "true or false"),
    "skip_special_tokens": (bool, "true or false"),
}


def check_common(body: dict[str, Any]) -> None:
    """RequestError when a shared field has the wrong JSON type (e.g. "stream": "false", a string)."""
    for key, (kind, what) in COMMON_TYPES.items():
        value = body.get(key)
        if value is not None and not isinstance(value, kind):
            raise RequestError(f"'{key}' must be {what}, got {json.dumps(value)[:80]}")
    if body.get("stream_options") is not None and not body.get("stream"):
        # as OpenAI and vLLM answer it: include_usage asked of a non-streamed call would be silently unmet
        raise RequestError(
            "'stream_options' is only allowed when 'stream' is true; drop it or stream the response",
            param="stream_options",
        )


def _number(body: dict[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"'{key}' must be a number", param=key)
    return float(value)


def int_field(body: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestError(f"'{key}' must be an integer", param=key)
        return value
    return None


def check_unsupported(body: dict[str, Any]) -> None:
    """RequestError for what the engine cannot honour and a client relies on: a logit_bias, or output constrained
    to JSON (response_format, Responses text.format); the engine samples the policy's own distribution, whose
    logprobs are what the trainer scores. presence and frequency penalties are range-checked here and applied
    by the sampler (see `sampling`)."""
    for key in ("presence_penalty", "frequency_penalty"):
        value = _number(body, key, 0.0)
        if not -2 <= value <= 2:
            raise RequestError(f"'{key}' must be in [-2, 2], got {value}", param=key)
    bias = body.get("logit_bias")
    if bias is not None and not isinstance(bias, dict):
        raise RequestError("'logit_bias' must be an object mapping token ids to biases", param="logit_bias")
    if bias:
        raise RequestError(
            "'logit_bias' is not supported: this engine samples the policy's own distribution (its logprobs are "
            "what training scores); drop logit_bias",
            param="logit_bias",
        )
    _check_vllm_extras(body)
    text = body.get("text")
    for key, fmt in (("response_format", body.get("response_format")), ("text.format", _field(text, "format"))):
        kind = _field(fmt, "type")
        if fmt is not None and kind != "text":
            raise RequestError(
                f"'{key}' of type {json.dumps(kind)} is not supported: this engine has no constrained decoding; "
                "drop it (or use type text) and ask for the format in the prompt",
                param=key,
            )


# vLLM's extra fields for output the engine cannot produce: constrained decoding, beam search, prompt scoring
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def _check_vllm_extras(body: dict[str, Any]) -> None:
    """RequestError for vLLM extra fields whose answer this engine would silently not give."""
    for key in GUIDED:
        if body.get(key) is not None:
            raise RequestError(
                f"'{key}' is not supported: this engine has no constrained decoding; drop it and ask for the "
                "format in the prompt",
                param=key,
            )
    if body.get("use_beam_search"):
        raise RequestError("'use_beam_search' is not supported: this engine samples; drop it", param="use_beam_search")
    best_of, n = body.get("best_of"), body.get("n")
    if best_of is not None and best_of != (1 if n is None else n):
        raise RequestError(
            f"'best_of' must equal n ({1 if n is None else n}) here: this engine returns every choice it samples; "
            "drop best_of or ask for n choices",
            param="best_of",
        )
    if body.get("prompt_logprobs") is not None:
        raise RequestError(
            "'prompt_logprobs' is not supported: this engine does not score the prompt; drop it",
            param="prompt_logprobs",
        )
    if body.get("include_stop_str_in_output"):
        raise RequestError(
            "'include_stop_str_in_output' is not supported: the text ends before the stop string, with the ids "
            "whose text it is (stop_reason names the string); drop it",
            param="include_stop_str_in_output",
        )


def _field(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, dict) else None


def sampling(
    body: dict[str, Any], max_tokens: int | None, default_max: int, stop: list[str], n: int = 1, top_logprobs: int = 0
) -> SamplingParams:
    """SamplingParams from common fields (temperature, top_p, seed) and the API-specific ones passed in."""
    check_unsupported(body)
    top_k = int_field(body, "top_k")
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
        top_k=0 if top_k is None or top_k == -1 else top_k,  # vLLM's -1 and 0 both mean every token
        min_p=_number(body, "min_p", 0.0),
        min_tokens=int_field(body, "min_tokens") or 0,
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        stop_token_ids=_id_list(body, "stop_token_ids"),
    )


def _id_list(body: dict[str, Any], key: str) -> list[int]:
    value = body.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise RequestError(f"'{key}' must be a list of token ids (integers)", param=key)
    if len(value) > MAX_STOP_STRINGS:
        raise RequestError(f"'{key}' has {len(value)} ids; send at most {MAX_STOP_STRINGS}", param=key)
    return list(dict.fromkeys(value))


# ---------------------------------------------------------------- request bodies as template messages
# The conversion lives in clawpipe.apis.requests (the proxy's retokenizer renders requests the same way);
# here its shape errors become the engine's 400s.


# content parts a text-only model cannot take in (chat, Responses and Anthropic spellings): refused with a 400
# rather than dropped, so a client never gets an answer to a prompt it did not send
MEDIA_PARTS = {
    *("image_url", "input_image", "image", "image_file", "document"),
    *("input_audio", "audio_url", "video_url", "file", "input_file"),
}
TEXT_PARTS = {"text", "input_text", "output_text"}


def check_parts(content: Any, where: str) -> None:
    """RequestError for a media part (image, audio, file) or a text part without string text in a content list;
    other shapes are left to the conversion, which names what is wrong with them."""
    if not isinstance(content, list):
        return
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            continue
        if kind in MEDIA_PARTS:
            raise RequestError(
                f"{where}[{i}] is a part of type {kind!r}, but this server's model reads text only; send the content "
                "as text"
            )
        if kind in TEXT_PARTS and not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{i}]: a {kind} part needs a string 'text', got {json.dumps(part)[:80]}")
        if kind == "tool_result":
            check_parts(part.get("content"), f"{where}[{i}].content")


def _check_messages(body: dict[str, Any], key: str, content: str = "content") -> None:
    """The check the shared conversion leaves to the engine: each message's content parts are ones a text-only
    model can read (see check_parts)."""
    messages = body.get(key)
    if not isinstance(messages, list):
        return
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        check_parts(m.get(content), f"{key}[{i}].{content}")
        if key == "input" and m.get("type") in ("function_call_output", "custom_tool_call_output"):
            check_parts(m.get("output"), f"{key}[{i}].output")


def _served(convert: Callable[[dict[str, Any]], T], body: dict[str, Any]) -> T:
    try:
        return convert(body)
    except RequestShapeError as exc:
        raise RequestError(str(exc)) from exc
    except RecursionError as exc:  # tool-call arguments sent as a JSON string nested past what json parses
        raise RequestError(
            "a JSON string in the request (tool-call arguments) nests too deeply to parse; flatten it"
        ) from exc


def chat_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(template messages, template tools) of a chat-completions body."""
    _check_messages(body, "messages")
    return _served(requests.chat_messages, body)


def input_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A Responses body's input as a list of items (a string is one user message)."""
    return _served(requests.input_items, body)


def responses_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(template messages, template tools) of a Responses body (instructions, input items, function tools)."""
    _check_messages(body, "input")
    check_parts(body.get("instructions"), "instructions")
    return _served(requests.responses_messages, body)


def anthropic_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(template messages, template tools) of an Anthropic Messages body, as Claude Code sends it."""
    _check_messages(body, "messages")
    check_parts(body.get("system"), "system")
    return _served(requests.anthropic_messages, body)


# ---------------------------------------------------------------- how the prompt ends: a new turn or a continued one


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{key}' must be true or false, got {json.dumps(value)[:80]}", param=key)
    return value


def chat_ending(body: dict[str, Any], messages: list[dict[str, Any]]) -> Ending:
    """How a chat prompt ends, by vLLM's extra fields: `add_generation_prompt` (default true) opens a new
    assistant turn; `continue_final_message` leaves the final assistant message open to be continued, and
    needs `add_generation_prompt` false (both true is a 400, as vLLM answers it); neither renders the messages
    as they are."""
    cont = _flag(body, "continue_final_message", False)
    gen = _flag(body, "add_generation_prompt", True)
    if cont and gen:
        raise RequestError(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true (add_generation_prompt "
            'defaults to true): send "add_generation_prompt": false to continue the final message',
            param="continue_final_message",
        )
    if not cont:
        return "generate" if gen else "closed"
    last = messages[-1]
    if last["role"] != "assistant":
        raise RequestError(
            f"'continue_final_message' continues the final assistant message, but the final message's role is "
            f"{last['role']!r}: end 'messages' with the assistant text to continue, or drop continue_final_message",
            param="continue_final_message",
        )
    if last.get("tool_calls"):
        raise RequestError(
            "'continue_final_message': the final assistant message has tool_calls, and only text can be "
            "continued; send the tool results after it, or drop its tool_calls",
            param="continue_final_message",
        )
    return "continue"


def anthropic_ending(body: dict[str, Any], messages: list[dict[str, Any]]) -> Ending:
    """How a Messages prompt ends: a final assistant message is a prefill the response continues from (its
    content then holds only the continuation), as the Messages API documents; otherwise a new turn.

    As that API answers them: prefill text ending in whitespace is a 400, and so is a tool_use block in the
    final assistant message (each tool_use needs its tool_result in a user message after it)."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        return "generate"
    final = raw[-1]
    if not isinstance(final, dict) or final.get("role") != "assistant" or messages[-1]["role"] != "assistant":
        return "generate"
    where = f"messages[{len(raw) - 1}]"
    content = final.get("content")
    for j, block in enumerate(content if isinstance(content, list) else []):
        if isinstance(block, dict) and block.get("type") in ("tool_use", "server_tool_use"):
            raise RequestError(
                f"{where}.content[{j}]: the final assistant message holds a {block['type']} block without its "
                "tool_result; send the tool_result in a user message after it (a response continues only text)"
            )
    text = str(messages[-1]["content"])
    if text != text.rstrip():
        raise RequestError(
            f"{where}: final assistant content cannot end with trailing whitespace; strip it (the response "
            "continues from exactly where the prefill ends)"
        )
    return "continue"
