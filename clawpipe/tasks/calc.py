"""``calc``: arithmetic with a calculator tool called through native tool calls.

The harness offers one tool, ``calculator(expression: str)``, evaluates the model's calls itself and sends
the results back (OpenAI ``tool`` messages / Anthropic ``tool_result`` blocks).

Transcript contract (``out/transcript.json``: a regular file, one plain JSON object, at most 4 MiB and 64
levels, no NaN or duplicate keys; anything else is reward 0 with a reason):

- ``turns``: a list with ONE ENTRY PER MODEL CALL, in order: ``{"reply": <the call's text, "" when it only
  called tools>, "tool_calls": [{"name": "calculator", "arguments": <a JSON string or an object holding
  "expression": string>, "result": <what the harness answered>}]}``.
- ``final``: the model's last text reply, a string. When it is not a string, the last turn's ``reply``
  stands in. The answer is the LAST number in it (``-?[0-9]+(.[0-9]+)?``).
- The verifier evaluates each ``calculator`` call's ``expression`` itself; ``result`` is ignored, as are
  calls with another name, entries that are not objects, ``answer`` keys and every other field.

Reward: 1.0 when the last number in ``final`` equals the answer; otherwise 0.5 when a calculator call's
expression evaluates to the answer (the tool was used properly, the answer not reported); 0.2 for any
calculator call with a well-formed expression; else 0. The verifier re-evaluates expressions itself.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from pathlib import Path
from typing import Any, cast

from clawpipe.tasks.base import as_text, data_view, read_transcript, sample_keys, transcript_turns

NAME = "calc"
MAX_TURNS = 4
SAMPLING = {"temperature": 1.0, "max_tokens": 64}
TOOL_NAME = "calculator"
REWARD_TOOL_CORRECT = 0.5
REWARD_TOOL_USED = 0.2
MAX_EXPRESSION_CHARS = 200
HARNESS_DATA = ("expression", "tool")  # what a harness sees of data; the answer is the verifier's alone
_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")
_BINOPS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Any] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return cast(float, node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 16 or abs(left) > 1e6):
            raise ValueError("exponent too large")
        value = _BINOPS[type(node.op)](left, right)
        if abs(value) > 1e18:
            raise ValueError("result too large")
        return value
    raise ValueError(f"unsupported element {type(node).__name__}")


def evaluate(expression: str) -> float:
    """Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses); ValueError otherwise."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError) as exc:
        raise ValueError(f"not an expression: {exc}") from exc
    try:
        return _eval(tree)
    except (ZeroDivisionError, OverflowError, RecursionError, TypeError) as exc:
        raise ValueError(str(exc)) from exc


def _expression_of(arguments: Any) -> str | None:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if isinstance(arguments, dict) and isinstance(arguments.get("expression"), str):
        return arguments["expression"]
    return None


def _draw(rng: Any) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
    form = rng.randrange(6)
    return [f"{a} + {b}", f"{a} - {b}", f"{a} * {c}", f"{a} * {c} + {b}", f"{a} + {b} * {c}", f"({a} + {b}) * {c}"][
        form
    ]


class CalcTaskSet:
    """Arithmetic questions answered with a calculator tool (native tool calls)."""

    name = NAME

    def generate(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        """``n`` questions; an instance is its expression, assigned to train or eval by a stable hash."""
        tasks = []
        for key in sample_keys(NAME, n, seed, split, _draw):
            expression = key.split("~")[0]
            tasks.append(
                {
                    "task_set": NAME,
                    "task_id": f"{NAME}-{key}".replace(" ", ""),
                    "prompt": f"What is {expression}? Use the calculator tool, then reply with the final answer "
                    "as a number.",
                    "data": {"expression": expression, "answer": int(evaluate(expression)), "tool": TOOL_NAME},
                    "max_turns": MAX_TURNS,
                    "sampling": dict(SAMPLING),
                }
            )
        return tasks

    def harness_task(self, task: dict[str, Any]) -> dict[str, Any]:
        """The task without ``data.answer``: the harness needs the expression and the tool's name only."""
        return data_view(task, HARNESS_DATA)

    def prepare(self, task: dict[str, Any], workdir: Path) -> None:
        """Nothing to write: the harness carries the calculator."""

    def verify(self, task: dict[str, Any], workdir: Path) -> tuple[float, dict[str, Any]]:
        """Reward from ``final`` and the calculator calls in ``out/transcript.json`` (see the module docstring)."""
        try:
            answer = float(task["data"]["answer"])
        except (KeyError, TypeError, ValueError) as exc:
            return 0.0, {"reason": f"task instance lacks data.answer: {exc}"}
        transcript, reason = read_transcript(workdir)
        if transcript is None:
            return 0.0, {"reason": reason}
        turns = transcript_turns(transcript)
        final = transcript.get("final")
        if not isinstance(final, str):
            final = as_text(turns[-1].get("reply")) if turns else ""
        numbers = _NUMBER.findall(as_text(final))
        final_value = float(numbers[-1]) if numbers else None
        n_calls = n_valid = n_correct = 0
        for turn in turns:
            calls = turn.get("tool_calls")
            for call in calls if isinstance(calls, list) else []:
                if not isinstance(call, dict) or call.get("name") != TOOL_NAME:
                    continue
                n_calls += 1
                expression = _expression_of(call.get("arguments"))
                try:
                    value = evaluate(expression) if expression is not None else None
                except ValueError:
                    value = None
                if value is not None:
                    n_valid += 1
                    n_correct += abs(value - answer) < 1e-9
        correct = final_value is not None and abs(final_value - answer) < 1e-9
        if correct:
            reward = 1.0
        elif n_correct:
            reward = REWARD_TOOL_CORRECT
        elif n_valid:
            reward = REWARD_TOOL_USED
        else:
            reward = 0.0
        info: dict[str, Any] = {
            "answer": task["data"]["answer"],
            "final_value": final_value,
            "correct": correct,
            "tool_calls": n_calls,
            "valid_tool_calls": n_valid,
            "correct_tool_calls": n_correct,
        }
        if reward == 0.0:
            info["reason"] = "no correct final answer and no well-formed calculator call"
        return reward, info
