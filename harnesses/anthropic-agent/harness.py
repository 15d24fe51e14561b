"""anthropic-agent: speaks the Anthropic Messages API through the anthropic SDK.

Plays ``guess`` as a plain text conversation (history appended) and ``calc`` with a ``calculator`` tool
through native ``tool_use`` / ``tool_result`` blocks; the calc loop ends on a reply without tool use or
after ``max_turns`` calls.
Reads CLAWPIPE_TASK, talks to ANTHROPIC_BASE_URL with CLAWPIPE_MODEL, writes
CLAWPIPE_OUTPUT/transcript.json after every turn. Exit 0 on a finished episode (garbage included), 1 when
the model API fails, 2 on a bad task file or an unsupported task set.
"""

import os
import sys
from pathlib import Path

import anthropic

HERE = Path(__file__).resolve().parent
sys.path.insert(0, os.environ.get("CLAWPIPE_HARNESS_KIT") or str(HERE.parent / "_kit"))  # harnesses/_kit/README.md
import harness_kit as kit  # noqa: E402

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


def text_of(resp: object) -> str:
    return "".join(getattr(b, "text", "") for b in getattr(resp, "content", None) or [] if b.type == "text")


def sampling_kw(task: dict, kind: str) -> dict:
    """max_tokens as an argument; temperature/top_p in the JSON body (this SDK's create() has no such
    parameters any more, the Messages API still accepts them; it allows temperature in [0, 1])."""
    kw = kit.sampling(task, DEFAULT_MAX_TOKENS[kind])
    extra = {"temperature": min(max(kw.pop("temperature"), 0.0), 1.0)}
    if "top_p" in kw:
        extra["top_p"] = kw.pop("top_p")
    return {**kw, "extra_body": extra}


def play_guess(client: anthropic.Anthropic, model: str, task: dict, rec: kit.Transcript) -> None:
    kw = sampling_kw(task, "guess")
    messages = [{"role": "user", "content": task["prompt"]}]
    rec.data["status"] = "max_turns"
    for _ in range(int(task.get("max_turns", 4))):
        resp = client.messages.create(model=model, system=SYSTEMS["guess"], messages=messages, **kw)
        rec.data["n_calls"] += 1
        reply = text_of(resp)
        playing, feedback = kit.record_guess(rec, reply, task["data"])
        if not playing:
            return
        # the Messages API rejects empty assistant text; "(empty)" keeps the conversation valid
        messages += [{"role": "assistant", "content": reply or "(empty)"}, {"role": "user", "content": feedback}]


def play_calc(client: anthropic.Anthropic, model: str, task: dict, rec: kit.Transcript) -> None:
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
                result = kit.calculate(str(args.get("expression", "")))
            record["tool_calls"].append({"name": use.name, "arguments": use.input, "result": result})
            blocks.append({"type": "tool_use", "id": use.id, "name": use.name, "input": use.input})
            results.append({"type": "tool_result", "tool_use_id": use.id, "content": result})
        messages += [{"role": "assistant", "content": blocks}, {"role": "user", "content": results}]
        rec.save()


def main() -> int:
    plays = {"guess": play_guess, "calc": play_calc}
    return kit.run(NAME, "anthropic", plays, anthropic.Anthropic, anthropic.AnthropicError)


if __name__ == "__main__":
    sys.exit(main())
