"""What the test upstream answers: scripted answers, and the rule that drives a real CLI harness through one
tool round (call its shell tool, then reply) whatever it names that tool.

The shell tool is found by its schema, not its name (:func:`find_shell_tool`), so every CLI's shell is
called: Claude Code's ``Bash``, Codex's ``exec_command``, Qwen Code's ``run_shell_command``, OpenClaw's
``exec``, and a CLI added later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from clawpipe.apis import request_messages
from clawpipe.errors import RequestShapeError

# Argument names that hold a shell command, and words that mark a tool as a shell in its name or description.
COMMAND_KEYS = ("command", "cmd", "script", "commands")
SHELL_WORDS = ("shell", "bash", "terminal", "exec", "command")


@dataclass
class Answer:
    """One scripted completion: text and/or tool calls (name, arguments)."""

    text: str = ""
    tool_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    finish_reason: str | None = None  # default: "tool_calls" when there are tool calls, else "stop"


def say(text: str) -> Answer:
    return Answer(text=text)


def tool_call(name: str, arguments: dict[str, Any], text: str = "") -> Answer:
    return Answer(text=text, tool_calls=[(name, arguments)])


# An answer decided from the request: (api, request body) -> Answer.
Decide = Callable[[str, dict[str, Any]], Answer]


@dataclass(frozen=True)
class ShellTool:
    """A tool found to run shell commands: its name, the argument that takes the command, whether that
    argument is an argv list (``["bash", "-lc", CMD]``) rather than a string, and its argument names."""

    name: str
    key: str
    argv: bool
    properties: tuple[str, ...]


def _tool_schema(tool: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(name, description, JSON schema of the arguments) of a tool of any of the three APIs."""
    fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool  # chat nests under "function"
    schema = fn.get("parameters") or fn.get("input_schema") or {}  # chat/responses vs messages
    return str(fn.get("name") or ""), str(fn.get("description") or ""), schema if isinstance(schema, dict) else {}


def _command_key(schema: dict[str, Any]) -> tuple[str, bool] | None:
    """The property that takes the command, and whether it is an argv list; None when there is none."""
    props = schema.get("properties") or {}
    required = schema.get("required") or []
    for key in COMMAND_KEYS:
        prop = props.get(key)
        if not isinstance(prop, dict) or key not in required:
            continue
        kind = prop.get("type")
        if kind == "string":
            return key, False
        if kind == "array" and (prop.get("items") or {}).get("type") == "string":
            return key, True
    return None


def find_shell_tool(tools: list[Any]) -> ShellTool | None:
    """The shell-like tool among ``tools`` (any API's tool list), found by schema alone.

    A candidate takes a REQUIRED command argument (``command``/``cmd``/``script``/``commands``) as a string or
    a list of strings. Among candidates the one whose name or description speaks of a shell
    (:data:`SHELL_WORDS`) wins, then the one with the fewest required arguments (a plain shell over a
    tool that needs more); ties keep the list's order. Tools that are not functions (hosted, namespaces)
    are ignored."""
    best: tuple[int, int, int] | None = None
    found: ShellTool | None = None
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "function", "custom"):
            continue
        name, description, schema = _tool_schema(tool)
        hit = _command_key(schema)
        if not name or hit is None:
            continue
        text = f"{name} {description}".lower()
        rank = (0 if any(w in text for w in SHELL_WORDS) else 1, len(schema.get("required") or []), i)
        if best is None or rank < best:
            best = rank
            found = ShellTool(name, hit[0], hit[1], tuple(schema.get("properties") or {}))
    return found


def _has_tool_result(api: str, body: dict[str, Any]) -> bool:
    try:
        messages, _ = request_messages(api, body)
    except RequestShapeError:
        return False
    return any(m["role"] == "tool" for m in messages)


def shell_then_reply(command: str = "echo scripted > tool_ran.txt", reply: str = "All done.") -> Decide:
    """A request that offers a shell tool and carries no tool result yet gets a call of that tool running
    ``command``; every other request (the follow-up with the tool's output, titles, side calls) gets ``reply``."""

    def decide(api: str, body: dict[str, Any]) -> Answer:
        shell = find_shell_tool(body.get("tools") or [])
        if api == "completions" or shell is None or _has_tool_result(api, body):
            return say(reply)
        args: dict[str, Any] = {shell.key: ["bash", "-lc", command] if shell.argv else command}
        if "description" in shell.properties:  # Claude Code's Bash asks for one
            args["description"] = "Run the scripted command"
        return tool_call(shell.name, args)

    return decide
