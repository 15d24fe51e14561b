"""The pieces every reference harness shares (stdlib only): task and environment reading, the transcript the
verifier reads, sampling options, guess feedback, the calculator tool, and the common ``main`` skeleton.

A harness puts this folder on ``sys.path`` (see README.md here) and imports it; it never imports clawpipe.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

DIGITS = re.compile(r"[0-9]+")


def load_task(name: str) -> dict:
    """The task instance at $CLAWPIPE_TASK; exit 2 (a bad task file) when it cannot be read."""
    try:
        task = json.loads(Path(os.environ["CLAWPIPE_TASK"]).read_text())
        assert isinstance(task, dict) and isinstance(task.get("data"), dict)
        return task
    except (KeyError, OSError, ValueError, AssertionError) as exc:
        print(f"{name}: cannot read the task from CLAWPIPE_TASK: {exc!r}", file=sys.stderr)
        sys.exit(2)


def client_options(api: str) -> dict[str, Any]:
    """Keyword arguments for the SDK client of ``api`` ("openai" or "anthropic"): the rollout's base URL and key,
    no retries (a retry would be a second model call), the request timeout."""
    prefix = "OPENAI" if api == "openai" else "ANTHROPIC"
    return {
        "base_url": os.environ.get(f"{prefix}_BASE_URL"),
        "api_key": os.environ.get(f"{prefix}_API_KEY") or "none",
        "max_retries": 0,
        "timeout": float(os.environ.get("CLAWPIPE_REQUEST_TIMEOUT") or 60),
    }


def model_name(api: str) -> str:
    """The served model name: $CLAWPIPE_MODEL, else $OPENAI_MODEL / $ANTHROPIC_MODEL, else "default"."""
    prefix = "OPENAI" if api == "openai" else "ANTHROPIC"
    return os.environ.get("CLAWPIPE_MODEL") or os.environ.get(f"{prefix}_MODEL") or "default"


class Transcript:
    """The record the verifier reads; rewritten atomically after every turn so a kill loses at most one."""

    def __init__(self, name: str, task: dict) -> None:
        out = Path(os.environ.get("CLAWPIPE_OUTPUT") or "out")
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "transcript.json"
        self.data = {
            "harness": name,
            "task_id": task.get("task_id"),
            "turns": [],
            "final": None,
            "n_calls": 0,
            "status": "running",
            "error": None,
        }
        self.save()

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)


def sampling(task: dict, default_max_tokens: int) -> dict:
    """temperature, max_tokens (and top_p) from the task's optional "sampling" table."""
    s = task.get("sampling") if isinstance(task.get("sampling"), dict) else {}
    kw = {"temperature": float(s.get("temperature", 1.0)), "max_tokens": int(s.get("max_tokens", default_max_tokens))}
    if "top_p" in s:
        kw["top_p"] = float(s["top_p"])
    return kw


def chat_reply(resp: Any) -> str:
    """The first choice's text of a chat completion ("" when there is none)."""
    return (resp.choices[0].message.content or "") if resp.choices else ""


# --- the environments: guess feedback and the calculator -------------------------------------------------


def judge(reply: str, data: dict) -> tuple[str, str]:
    """(outcome, feedback) for one guess: the first integer in it; outcome is "won", "lost" or "play"."""
    lo, hi, target = data["lo"], data["hi"], data["target"]
    m = DIGITS.search(reply)
    guess = int(m.group()[:9]) if m else None
    if guess is None or not lo <= guess <= hi:
        return "lost", f"No number from {lo} to {hi}. Game over."
    if guess == target:
        return "won", "Correct!"
    return "play", "Higher." if guess < target else "Lower."


def record_guess(rec: Transcript, reply: str, data: dict, **extra: Any) -> tuple[bool, str]:
    """Judge one guess reply and record the turn ({"reply", "feedback", **extra}); (game goes on, feedback).

    When the game ended the transcript's status becomes "won" or "lost" (saved by the caller's next save)."""
    outcome, feedback = judge(reply, data)
    rec.data["turns"].append({"reply": reply, "feedback": feedback, **extra})
    rec.save()
    if outcome != "play":
        rec.data["status"] = outcome
    return outcome == "play", feedback


def note(reply: str, feedback: str) -> str:
    """One guess turn as a short note ("6 -> Higher." or "no number")."""
    m = DIGITS.search(reply)
    return f"{m.group()[:9]} -> {feedback}" if m else "no number"


OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """The calculator tool's result: safe arithmetic (numbers, + - * / // % ** and parentheses) or "error: ..."."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 16 or abs(left) > 1e6):
                raise ValueError("exponent too large")
            return OPS[type(node.op)](left, right)
        raise ValueError(f"unsupported element {type(node).__name__}")

    if len(expression) > 200:
        return "error: expression too long"
    try:
        value = ev(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError, TypeError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else repr(value)


# --- the program ------------------------------------------------------------------------------------------

Play = Callable[[Any, str, dict, Transcript], None]


def run(name: str, api: str, plays: Mapping[str, Play], make_client: Callable[..., Any], api_error: type) -> int:
    """A harness's whole ``main``: read the task, pick its play by task set, write the transcript.

    ``make_client(**client_options(api))`` builds the SDK client; ``plays[task_set](client, model, task, rec)``
    plays one episode. Exit 0 on a finished episode (garbage replies included), 1 when the model API raises
    ``api_error``, 2 on a bad task file or an unsupported task set.
    """
    task = load_task(name)
    if task.get("task_set") not in plays:
        allowed = f"only {next(iter(plays))}" if len(plays) == 1 else f"use {sorted(plays)}"
        print(f"{name}: task set {task.get('task_set')!r} is not supported ({allowed})", file=sys.stderr)
        return 2
    rec = Transcript(name, task)
    client = make_client(**client_options(api))
    model = model_name(api)
    try:
        plays[task["task_set"]](client, model, task, rec)
    except api_error as exc:
        rec.data.update(status="error", error=f"{type(exc).__name__}: {exc}"[:1000])
        rec.save()
        print(f"{name}: model API failed: {rec.data['error']}", file=sys.stderr)
        return 1
    rec.save()
    return 0
