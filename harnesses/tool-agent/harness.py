"""tool-agent: a native tool-calling agent (OpenAI tools) with the openai SDK.

Plays ``calc`` with a ``calculator`` tool, ``guess`` with a ``guess`` tool (a plain-text reply is also read
as a guess, so an untrained policy still plays) and ``fixit`` with ``read_file`` / ``write_file`` /
``run_check`` tools confined to the work dir. Every tool call gets a ``tool`` message with its result.
A turn is one model call; the loop ends on a text reply without tool calls (calc, fixit), on "Correct!"
(guess), or after ``max_turns`` calls.
Reads CLAWPIPE_TASK, talks to OPENAI_BASE_URL with CLAWPIPE_MODEL, writes CLAWPIPE_OUTPUT/transcript.json
after every turn. Exit 0 on a finished episode (garbage included), 1 when the model API fails, 2 on a bad
task file or an unsupported task set.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import openai

HERE = Path(__file__).resolve().parent
sys.path.insert(0, os.environ.get("CLAWPIPE_HARNESS_KIT") or str(HERE.parent / "_kit"))  # harnesses/_kit/README.md
import harness_kit as kit  # noqa: E402

NAME = "tool-agent"
SYSTEMS = {
    "calc": "You solve arithmetic. Use the calculator tool, then state the final answer.",
    "guess": "You are playing a number guessing game. Use the guess tool.",
    "fixit": "You fix Python programs. Use the tools to read and write files and to run the check.",
}


def tool(name: str, description: str, properties: dict, required: list) -> dict:
    schema = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


TOOLS = {
    "calc": [
        tool(
            "calculator",
            "Evaluate an arithmetic expression such as 12 * (3 + 4).",
            {"expression": {"type": "string"}},
            ["expression"],
        )
    ],
    "guess": [
        tool(
            "guess",
            "Guess the number. Returns Higher., Lower. or Correct!",
            {"number": {"type": "integer"}},
            ["number"],
        )
    ],
    "fixit": [
        tool("read_file", "Read a file in the work directory.", {"path": {"type": "string"}}, ["path"]),
        tool(
            "write_file",
            "Write a file in the work directory.",
            {"path": {"type": "string"}, "content": {"type": "string"}},
            ["path", "content"],
        ),
        tool("run_check", "Run `python3 check.py` and return its output.", {}, []),
    ],
}
DEFAULT_MAX_TOKENS = {"calc": 64, "guess": 32, "fixit": 1024}


# --- the environment's tools ---------------------------------------------------------------------------


def inside_workdir(path: str) -> Path:
    root = Path.cwd().resolve()
    target = (root / path).resolve()
    if target != root and root not in target.parents:
        raise ValueError(f"{path} is outside the work directory")
    return target


def run_fixit_tool(name: str, args: dict) -> str:
    try:
        if name == "read_file":
            return inside_workdir(str(args.get("path", ""))).read_text(errors="replace")[:20000]
        if name == "write_file":
            inside_workdir(str(args.get("path", ""))).write_text(str(args.get("content", "")))
            return "ok"
        if name == "run_check":
            proc = subprocess.run([sys.executable, "check.py"], capture_output=True, text=True, timeout=30)
            return f"exit code {proc.returncode}\n{(proc.stdout + proc.stderr)[-4000:]}"
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        return f"error: {exc}"
    return f"error: unknown tool {name}"


def parse_arguments(raw: object) -> dict | None:
    if isinstance(raw, dict):
        return raw
    try:
        args = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return None
    return args if isinstance(args, dict) else None


# --- the loop ------------------------------------------------------------------------------------------


def run_episode(client: openai.OpenAI, model: str, task: dict, rec: kit.Transcript) -> None:
    kind = task["task_set"]
    kw = kit.sampling(task, DEFAULT_MAX_TOKENS[kind])
    messages = [{"role": "system", "content": SYSTEMS[kind]}, {"role": "user", "content": task["prompt"]}]
    rec.data["status"] = "max_turns"
    for turn in range(int(task.get("max_turns", 4))):
        resp = client.chat.completions.create(model=model, messages=messages, tools=TOOLS[kind], **kw)
        rec.data["n_calls"] += 1
        message = resp.choices[0].message if resp.choices else None
        text = (message.content or "") if message else ""
        calls = list((message.tool_calls or []) if message else [])
        record = {"reply": text, "tool_calls": []}
        rec.data["turns"].append(record)
        if not calls:
            rec.data["final"] = text
            if kind != "guess":
                rec.data["status"] = "done"
                rec.save()
                return
            outcome, feedback = kit.judge(text, task["data"])
            record["feedback"] = feedback
            rec.save()
            if outcome != "play":
                rec.data["status"] = outcome
                return
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": feedback}]
            continue
        ids = [getattr(c, "id", None) or f"call_{turn}_{i}" for i, c in enumerate(calls)]
        messages.append(
            {
                "role": "assistant",
                "content": text or None,
                "tool_calls": [
                    {
                        "id": i,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": c.function.arguments or "{}"},
                    }
                    for i, c in zip(ids, calls, strict=True)
                ],
            }
        )
        outcome = "play"
        for call_id, call in zip(ids, calls, strict=True):
            name, raw = call.function.name, call.function.arguments
            args = parse_arguments(raw)
            if args is None:
                result = "error: arguments must be a JSON object"
            elif kind == "calc" and name == "calculator":
                result = kit.calculate(str(args.get("expression", "")))
            elif kind == "guess" and name == "guess":
                if "answer" in record:
                    result = "One guess per turn."
                else:
                    record["answer"] = str(args.get("number", ""))
                    outcome, result = kit.judge(record["answer"], task["data"])
            elif kind == "fixit":
                result = run_fixit_tool(name, args)
            else:
                result = f"error: unknown tool {name}"
            record["tool_calls"].append(
                {"name": name, "arguments": args if args is not None else raw, "result": result}
            )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
        rec.save()
        if outcome != "play":
            rec.data["status"] = outcome
            return


def main() -> int:
    plays = {kind: run_episode for kind in TOOLS}
    return kit.run(NAME, "openai", plays, openai.OpenAI, openai.OpenAIError)


if __name__ == "__main__":
    sys.exit(main())
