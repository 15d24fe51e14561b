"""Request translation: OpenAI Chat, OpenAI Responses and Anthropic Messages bodies -> chat-template messages,
tools and sampling parameters. Everything a harness sends that the engine cannot honour (cache_control,
thinking, beta features, metadata, include, ...) is accepted and ignored; malformed input raises
RequestError with a message naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from clawpipe.serving.params import RequestError, SamplingParams

CHAT_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def _text_of(content: Any, where: str) -> str:
    """Flatten a content value (string or list of parts/blocks) to text; non-text parts are dropped."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    out.append(text)
                elif part.get("type") in ("tool_result", "tool_use"):
                    raise RequestError(f"{where}[{i}]: a {part['type']} block is not allowed here")
            else:
                raise RequestError(f"{where}[{i}]: content parts must be objects or strings")
        return "".join(out)
    if isinstance(content, dict) and isinstance(content.get("text"), str):
        return content["text"]
    raise RequestError(f"{where}: content must be a string or a list of content parts")


def _system_messages(body: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """A one-element list holding the system message of a top-level text field (Responses ``instructions``,
    Anthropic ``system``), or an empty list when the body has none: the start of the template messages."""
    text = body.get(key)
    return [] if text is None else [{"role": "system", "content": _text_of(text, key)}]


def _json_args(value: Any, where: str) -> str:
    if value is None:
        return "{}"
    if isinstance(value, str):
        try:
            json.loads(value or "{}")
        except ValueError as exc:
            raise RequestError(f"{where}: arguments must be a JSON object string ({exc})") from exc
        return value or "{}"
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    raise RequestError(f"{where}: arguments must be a JSON object or a JSON string")


def _tool_call(name: Any, arguments: Any, call_id: Any, where: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}: a tool call needs a non-empty string name")
    return {
        "id": str(call_id or ""),
        "type": "function",
        "function": {"name": name, "arguments": _json_args(arguments, where)},
    }


def _function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}: a function tool needs a non-empty string 'name'")
    if parameters is not None and not isinstance(parameters, dict):
        raise RequestError(f"{where} ({name}): 'parameters' must be a JSON Schema object")
    if description is not None and not isinstance(description, str):
        raise RequestError(f"{where} ({name}): 'description' must be a string")
    fn: dict[str, Any] = {"name": name}
    if description:
        fn["description"] = description
    fn["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


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


def _list(body: dict[str, Any], key: str) -> list[Any]:
    value = body.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise RequestError(f"'{key}' must be a list")
    return value


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


# ---------------------------------------------------------------- OpenAI Chat Completions


def chat_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(template messages, template tools) of a chat-completions body."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects")
    messages = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise RequestError(f"{where}.role must be one of {sorted(CHAT_ROLES)}, got {role!r}")
        msg: dict[str, Any] = {
            "role": {"developer": "system", "function": "tool"}.get(role, role),
            "content": _text_of(m.get("content"), f"{where}.content"),
        }
        if role == "assistant" and m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise RequestError(f"{where}.tool_calls must be a list")
            calls = []
            for j, tc in enumerate(m["tool_calls"]):
                fn = tc.get("function") if isinstance(tc, dict) else None
                if not isinstance(fn, dict):
                    raise RequestError(f"{where}.tool_calls[{j}] must be {{id, type, function: {{name, arguments}}}}")
                calls.append(_tool_call(fn.get("name"), fn.get("arguments"), tc.get("id"), f"{where}.tool_calls[{j}]"))
            msg["tool_calls"] = calls
        messages.append(msg)
    tools = []
    for i, t in enumerate(_list(body, "tools")):
        where = f"tools[{i}]"
        if (
            not isinstance(t, dict)
            or t.get("type", "function") != "function"
            or not isinstance(t.get("function"), dict)
        ):
            raise RequestError(f"{where} must be {{type: 'function', function: {{name, description, parameters}}}}")
        fn = t["function"]
        tools.append(_function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), where))
    return messages, tools


# ---------------------------------------------------------------- OpenAI Responses


def input_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A Responses body's input as a list of items (a string is one user message)."""
    items = body.get("input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise RequestError("'input' must be a string or a list of input items")
    return items


def responses_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(template messages, template tools) of a Responses body (instructions, input items, function tools)."""
    messages = _system_messages(body, "instructions")
    for i, item in enumerate(input_items(body)):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise RequestError(f"{where}.role must be system, developer, user or assistant, got {role!r}")
            messages.append(
                {"role": "system" if role == "developer" else role, "content": _text_of(item.get("content"), where)}
            )
        elif kind in ("function_call", "custom_tool_call", "local_shell_call"):
            name = item.get("name") or ("local_shell" if kind == "local_shell_call" else None)
            args = item.get("arguments", item.get("input", item.get("action")))
            if kind == "custom_tool_call" and isinstance(args, str):
                args = json.dumps({"input": args})
            call = _tool_call(name, args, item.get("call_id"), where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            messages.append({"role": "tool", "content": text})
        # reasoning, web_search_call, item_reference, ...: nothing the template can render; ignored
    if not messages:
        raise RequestError("'input' is empty: send at least one message")
    tools = []
    for i, t in enumerate(_list(body, "tools")):
        if not isinstance(t, dict):
            raise RequestError(f"tools[{i}] must be an object")
        if t.get("type") == "function":
            tools.append(_function_tool(t.get("name"), t.get("description"), t.get("parameters"), f"tools[{i}]"))
        # hosted tools (web_search, namespace, custom, local_shell): ignored, this engine cannot run them
    return messages, tools


# ---------------------------------------------------------------- Anthropic Messages


def anthropic_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(template messages, template tools) of an Anthropic Messages body, as Claude Code sends it."""
    messages = _system_messages(body, "system")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects")
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise RequestError(f"{where} must be an object with role user, assistant or system")
        content = m.get("content")
        if isinstance(content, str):
            messages.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(f"{where}.content must be a string or a list of content blocks")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[str] = []
        for j, block in enumerate(content):
            bw = f"{where}.content[{j}]"
            if not isinstance(block, dict):
                raise RequestError(f"{bw} must be a content block object")
            kind = block.get("type")
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise RequestError(f"{bw}: a text block needs a string 'text'")
                texts.append(block["text"])
            elif kind in ("tool_use", "server_tool_use"):
                if m["role"] != "assistant":
                    raise RequestError(f"{bw}: tool_use blocks belong to assistant messages")
                calls.append(_tool_call(block.get("name"), block.get("input"), block.get("id"), bw))
            elif kind == "tool_result":
                results.append(_text_of(block.get("content"), f"{bw}.content"))
            # thinking, redacted_thinking, image, document, ...: ignored
        if results:
            for r in results:
                messages.append({"role": "tool", "content": r})
            if texts:
                messages.append({"role": "user", "content": "".join(texts)})
        else:
            msg: dict[str, Any] = {"role": m["role"], "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            messages.append(msg)
    tools = []
    for i, t in enumerate(_list(body, "tools")):
        if not isinstance(t, dict):
            raise RequestError(f"tools[{i}] must be an object")
        if "input_schema" in t or t.get("type") in (None, "custom"):
            tools.append(_function_tool(t.get("name"), t.get("description"), t.get("input_schema"), f"tools[{i}]"))
        # server tools (web_search_20250305, bash_20250124, ...): ignored
    return messages, tools
