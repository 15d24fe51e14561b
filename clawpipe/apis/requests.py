"""Request bodies of the chat, responses and messages APIs as chat-template messages and tools.

One conversion for everything that renders a request with the model's chat template: the serving engine
(to sample) and the proxy's retokenizer (to re-encode calls whose upstream sent no ids). Template messages
are ``{"role": system | user | assistant | tool, "content": str}`` with ``tool_calls`` (OpenAI chat shape,
arguments as a JSON string) on assistant turns; template tools are ``{"type": "function", "function":
{"name", "description", "parameters"}}``. What a template cannot render (images, thinking, hosted tools,
cache_control, ...) is dropped; a malformed body raises :class:`RequestShapeError` naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from clawpipe.errors import RequestShapeError

CHAT_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def text_of(content: Any, where: str = "content") -> str:
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
                text = part.get("text", part.get("refusal"))  # a Responses refusal part says it in "refusal"
                if isinstance(text, str):
                    out.append(text)
                elif part.get("type") in ("tool_result", "tool_use"):
                    raise RequestShapeError(f"{where}[{i}]: a {part['type']} block is not allowed here")
            else:
                raise RequestShapeError(f"{where}[{i}]: content parts must be objects or strings")
        return "".join(out)
    if isinstance(content, dict) and isinstance(content.get("text"), str):
        return content["text"]
    raise RequestShapeError(f"{where}: content must be a string or a list of content parts")


def _system_messages(body: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """A one-element list holding the system message of a top-level text field (Responses ``instructions``,
    Anthropic ``system``), or an empty list when the body has none: the start of the template messages."""
    text = body.get(key)
    return [] if text is None else [{"role": "system", "content": text_of(text, key)}]


def _json_args(value: Any, where: str) -> str:
    if value is None:
        return "{}"
    if isinstance(value, str):
        try:
            json.loads(value or "{}")
        except ValueError as exc:
            raise RequestShapeError(f"{where}: arguments must be a JSON object string ({exc})") from exc
        return value or "{}"
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    raise RequestShapeError(f"{where}: arguments must be a JSON object or a JSON string")


def _tool_call(name: Any, arguments: Any, call_id: Any, where: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise RequestShapeError(f"{where}: a tool call needs a non-empty string name")
    return {
        "id": str(call_id or ""),
        "type": "function",
        "function": {"name": name, "arguments": _json_args(arguments, where)},
    }


def _function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise RequestShapeError(f"{where}: a function tool needs a non-empty string 'name'")
    if parameters is not None and not isinstance(parameters, dict):
        raise RequestShapeError(f"{where} ({name}): 'parameters' must be a JSON Schema object")
    if description is not None and not isinstance(description, str):
        raise RequestShapeError(f"{where} ({name}): 'description' must be a string")
    fn: dict[str, Any] = {"name": name}
    if description:
        fn["description"] = description
    fn["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


def _list(body: dict[str, Any], key: str) -> list[Any]:
    value = body.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise RequestShapeError(f"'{key}' must be a list")
    return value


def chat_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(template messages, template tools) of a chat-completions body."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestShapeError("'messages' must be a non-empty list of {role, content} objects")
    messages = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestShapeError(f"{where} must be an object with 'role' and 'content'")
        role = m.get("role")
        if not isinstance(role, str):  # a list or an object cannot be looked up in a set (unhashable)
            raise RequestShapeError(f"{where}.role must be one of {sorted(CHAT_ROLES)}, got a {type(role).__name__}")
        if role not in CHAT_ROLES:
            raise RequestShapeError(f"{where}.role must be one of {sorted(CHAT_ROLES)}, got {role!r}")
        content = m.get("content")
        if role == "assistant" and content is None and isinstance(m.get("refusal"), str):
            content = m["refusal"]  # what the model answered when it refused: its turn is that text
        msg: dict[str, Any] = {
            "role": {"developer": "system", "function": "tool"}.get(role, role),
            "content": text_of(content, f"{where}.content"),
        }
        if role == "assistant" and m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise RequestShapeError(f"{where}.tool_calls must be a list")
            calls = []
            for j, tc in enumerate(m["tool_calls"]):
                fn = tc.get("function") if isinstance(tc, dict) else None
                if not isinstance(fn, dict):
                    raise RequestShapeError(
                        f"{where}.tool_calls[{j}] must be {{id, type, function: {{name, arguments}}}}"
                    )
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
            raise RequestShapeError(
                f"{where} must be {{type: 'function', function: {{name, description, parameters}}}}"
            )
        fn = t["function"]
        tools.append(_function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), where))
    return messages, tools


def input_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A Responses body's input as a list of items (a string is one user message)."""
    items = body.get("input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise RequestShapeError("'input' must be a string or a list of input items")
    return items


def responses_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(template messages, template tools) of a Responses body (instructions, input items, function tools)."""
    messages = _system_messages(body, "instructions")
    for i, item in enumerate(input_items(body)):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestShapeError(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise RequestShapeError(f"{where}.role must be system, developer, user or assistant, got {role!r}")
            messages.append(
                {"role": "system" if role == "developer" else role, "content": text_of(item.get("content"), where)}
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
            text = output if isinstance(output, str) else text_of(output, f"{where}.output")
            messages.append({"role": "tool", "content": text})
        # reasoning, web_search_call, item_reference, ...: nothing the template can render; ignored
    if not messages:
        raise RequestShapeError("'input' is empty: send at least one message")
    tools = []
    for i, t in enumerate(_list(body, "tools")):
        if not isinstance(t, dict):
            raise RequestShapeError(f"tools[{i}] must be an object")
        if t.get("type") == "function":
            tools.append(_function_tool(t.get("name"), t.get("description"), t.get("parameters"), f"tools[{i}]"))
        # hosted tools (web_search, namespace, custom, local_shell): ignored, this engine cannot run them
    return messages, tools


def anthropic_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(template messages, template tools) of an Anthropic Messages body, as Claude Code sends it."""
    messages = _system_messages(body, "system")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestShapeError("'messages' must be a non-empty list of {role, content} objects")
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise RequestShapeError(f"{where} must be an object with role user, assistant or system")
        content = m.get("content")
        if isinstance(content, str):
            messages.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise RequestShapeError(f"{where}.content must be a string or a list of content blocks")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[str] = []
        for j, block in enumerate(content):
            bw = f"{where}.content[{j}]"
            if not isinstance(block, dict):
                raise RequestShapeError(f"{bw} must be a content block object")
            kind = block.get("type")
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise RequestShapeError(f"{bw}: a text block needs a string 'text'")
                texts.append(block["text"])
            elif kind == "tool_use":
                if m["role"] != "assistant":
                    raise RequestShapeError(f"{bw}: tool_use blocks belong to assistant messages")
                calls.append(_tool_call(block.get("name"), block.get("input"), block.get("id"), bw))
            elif kind == "tool_result":
                results.append(text_of(block.get("content"), f"{bw}.content"))
            # thinking, redacted_thinking, image, document, ...: ignored; so are a server tool's call
            # (server_tool_use) and its result block, which the API ran itself: as template tool calls they
            # would take the places of the harness's tool results that follow
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
            raise RequestShapeError(f"tools[{i}] must be an object")
        if "input_schema" in t or t.get("type") in (None, "custom"):
            tools.append(_function_tool(t.get("name"), t.get("description"), t.get("input_schema"), f"tools[{i}]"))
        # server tools (web_search_20250305, bash_20250124, ...): ignored
    return messages, tools


def request_messages(api: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(template messages, template tools) of a chat, responses or messages request body."""
    if api == "chat":
        return chat_messages(body)
    if api == "responses":
        return responses_messages(body)
    if api == "messages":
        return anthropic_messages(body)
    raise RequestShapeError(f"{api!r} requests have no chat messages; known: chat, responses, messages")
