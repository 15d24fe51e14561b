"""anthropic-agent: speaks the Anthropic Messages API through the anthropic SDK.

Plays ``guess`` as a plain text conversation (history appended) and ``calc`` with a ``calculator`` tool
through native ``tool_use`` / ``tool_result`` blocks; the calc loop ends on a reply without tool use or
after ``max_turns`` calls.
Reads CLAWPIPE_TASK, talks to ANTHROPIC_BASE_URL with CLAWPIPE_MODEL, writes
CLAWPIPE_OUTPUT/transcript.json after every turn. Exit 0 on a finished episode (garbage included), 1 when
the model API fails, 2 on a bad task file or an unsupported task set.
"""

import ast
import json
import operator
import os
import re
import sys
from pathlib import Path

import anthropic

NAME = "anthropic-agent"
SYSTEMS = {
    "calc": "You solve arithmetic. Use the calculator tool, then state the final answer.",
    "guess": "You are playing a number guessing game.",
}
CALCULATOR = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression such as 12 * (3 + 4).",
    "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}
DEFAULT_MAX_TOKENS = {"calc": 64, "guess": 16}
DIGITS = re.compile(r"[0-9]+")


def load_task() -> dict:
    try:
        task = json.loads(Path(os.environ["CLAWPIPE_TASK"]).read_text())
        assert isinstance(task, dict) and isinstance(task.get("data"), dict)
        return task
    except (KeyError, OSError, ValueError, AssertionError) as exc:
        print(f"{NAME}: cannot read the task from CLAWPIPE_TASK: {exc!r}", file=sys.stderr)
        sys.exit(2)


class Transcript:
    """The record the verifier reads; rewritten atomically after every turn so a kill loses at most one."""

    def __init__(self, task: dict) -> None:
        out = Path(os.environ.get("CLAWPIPE_OUTPUT") or "out")
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "transcript.json"
        self.data = {
            "harness": NAME,
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
    s = task.get("sampling") if isinstance(task.get("sampling"), dict) else {}
    kw = {"temperature": float(s.get("temperature", 1.0)), "max_tokens": int(s.get("max_tokens", default_max_tokens))}
    if "top_p" in s:
        kw["top_p"] = float(s["top_p"])
    return kw


# --- the environment: calculator and guess feedback ---

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
    """Safe arithmetic: numbers, + - * / // % ** and parentheses."""

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


def judge(text: str, data: dict) -> tuple[str, str]:
    """(outcome, feedback) for one guess: the first integer in it; outcome is "won", "lost" or "play"."""
    lo, hi, target = data["lo"], data["hi"], data["target"]
    m = DIGITS.search(text)
    guess = int(m.group()[:9]) if m else None
    if guess is None or not lo <= guess <= hi:
        return "lost", f"No number from {lo} to {hi}. Game over."
    if guess == target:
        return "won", "Correct!"
    return "play", "Higher." if guess < target else "Lower."


def text_of(resp: object) -> str:
    return "".join(getattr(b, "text", "") for b in getattr(resp, "content", None) or [] if b.type == "text")


def sampling_kw(task: dict, kind: str) -> dict:
    """max_tokens as an argument; temperature/top_p in the JSON body (this SDK's create() has no such
    parameters any more, the Messages API still accepts them; it allows temperature in [0, 1])."""
    kw = sampling(task, DEFAULT_MAX_TOKENS[kind])
    extra = {"temperature": min(max(kw.pop("temperature"), 0.0), 1.0)}
    if "top_p" in kw:
        extra["top_p"] = kw.pop("top_p")
    return {**kw, "extra_body": extra}


def play_guess(client: anthropic.Anthropic, model: str, task: dict, rec: Transcript) -> None:
    kw = sampling_kw(task, "guess")
    messages = [{"role": "user", "content": task["prompt"]}]
    rec.data["status"] = "max_turns"
    for _ in range(int(task.get("max_turns", 4))):
        resp = client.messages.create(model=model, system=SYSTEMS["guess"], messages=messages, **kw)
        rec.data["n_calls"] += 1
        reply = text_of(resp)
        outcome, feedback = judge(reply, task["data"])
        rec.data["turns"].append({"reply": reply, "feedback": feedback})
        rec.save()
        if outcome != "play":
            rec.data["status"] = outcome
            return
        # the Messages API rejects empty assistant text; "(empty)" keeps the conversation valid
        messages += [{"role": "assistant", "content": reply or "(empty)"}, {"role": "user", "content": feedback}]


def play_calc(client: anthropic.Anthropic, model: str, task: dict, rec: Transcript) -> None:
    kw = sampling_kw(task, "calc")
    messages: list[dict] = [{"role": "user", "content": task["prompt"]}]
    rec.data["status"] = "max_turns"
    for _ in range(int(task.get("max_turns", 4))):
        resp = client.messages.create(model=model, system=SYSTEMS["calc"], messages=messages, tools=[CALCULATOR], **kw)
        rec.data["n_calls"] += 1
        text = text_of(resp)
        uses = [b for b in resp.content or [] if b.type == "tool_use"]
        record = {"reply": text, "tool_calls": []}
        rec.data["turns"].append(record)
        if not uses:
            rec.data.update(final=text, status="done")
            rec.save()
            return
        blocks: list[dict] = [{"type": "text", "text": text}] if text else []
        results = []
        for use in uses:
            args = use.input if isinstance(use.input, dict) else None
            if use.name != "calculator":
                result = f"error: unknown tool {use.name}"
            elif args is None:
                result = "error: input must be an object"
            else:
                result = calculate(str(args.get("expression", "")))
            record["tool_calls"].append({"name": use.name, "arguments": use.input, "result": result})
            blocks.append({"type": "tool_use", "id": use.id, "name": use.name, "input": use.input})
            results.append({"type": "tool_result", "tool_use_id": use.id, "content": result})
        messages += [{"role": "assistant", "content": blocks}, {"role": "user", "content": results}]
        rec.save()


def main() -> int:
    task = load_task()
    plays = {"guess": play_guess, "calc": play_calc}
    if task.get("task_set") not in plays:
        print(f"{NAME}: task set {task.get('task_set')!r} is not supported (use {sorted(plays)})", file=sys.stderr)
        return 2
    rec = Transcript(task)
    client = anthropic.Anthropic(
        base_url=os.environ.get("ANTHROPIC_BASE_URL"),
        api_key=os.environ.get("ANTHROPIC_API_KEY") or "none",
        max_retries=0,
        timeout=float(os.environ.get("CLAWPIPE_REQUEST_TIMEOUT") or 60),
    )
    model = os.environ.get("CLAWPIPE_MODEL") or os.environ.get("ANTHROPIC_MODEL") or "default"
    try:
        plays[task["task_set"]](client, model, task, rec)
    except anthropic.AnthropicError as exc:
        rec.data.update(status="error", error=f"{type(exc).__name__}: {exc}"[:1000])
        rec.save()
        print(f"{NAME}: model API failed: {rec.data['error']}", file=sys.stderr)
        return 1
    rec.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
