"""subagent: interleaves a helper sub-agent's calls with its own in one rollout.

Plays ``guess`` with the openai SDK. Before every main turn after the first, a helper call with its own
system prompt sees a summary of the game so far and suggests a guess; the main agent's next user message
carries the feedback plus the helper's (truncated) suggestion. The main history is appended as in a
chat loop, so the calls alternate main, helper, main, helper, ... with two different system prompts.
Reads CLAWPIPE_TASK, talks to OPENAI_BASE_URL with CLAWPIPE_MODEL, writes CLAWPIPE_OUTPUT/transcript.json
after every turn. Exit 0 on a finished game (garbage replies included), 1 when the model API fails, 2 on a
bad task file.
"""

import os
import sys
from pathlib import Path

import openai

HERE = Path(__file__).resolve().parent
sys.path.insert(0, os.environ.get("CLAWPIPE_HARNESS_KIT") or str(HERE.parent / "_kit"))  # harnesses/_kit/README.md
import harness_kit as kit  # noqa: E402

NAME = "subagent"
SYSTEM = "You are playing a number guessing game. A helper may suggest guesses."
HELPER_SYSTEM = "You are a helper. Suggest the next guess as a number."
HELPER_CHARS = 64


def ask_helper(client: openai.OpenAI, model: str, task: dict, kw: dict, log: list[str]) -> str:
    """The sub-agent: a fresh conversation with its own system prompt; returns its suggestion text."""
    lo, hi = task["data"]["lo"], task["data"]["hi"]
    summary = f"Game: a number from {lo} to {hi}. So far: " + "; ".join(log)
    resp = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": HELPER_SYSTEM}, {"role": "user", "content": summary}],
        **kw,
    )
    return kit.chat_reply(resp)


def play_guess(client: openai.OpenAI, model: str, task: dict, rec: kit.Transcript) -> None:
    kw = kit.sampling(task, 16)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
    log: list[str] = []
    helper = None
    rec.data["status"] = "max_turns"
    for _ in range(int(task.get("max_turns", 4))):
        resp = client.chat.completions.create(model=model, messages=messages, **kw)
        rec.data["n_calls"] += 1
        reply = kit.chat_reply(resp)
        playing, feedback = kit.record_guess(rec, reply, task["data"], helper=helper)
        if not playing:
            break
        log.append(kit.note(reply, feedback))
        if len(rec.data["turns"]) >= int(task.get("max_turns", 4)):
            break
        helper = ask_helper(client, model, task, kw, log)
        rec.data["n_calls"] += 1
        suggestion = " ".join(helper.split())[:HELPER_CHARS]
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"{feedback} Helper suggests: {suggestion}"},
        ]


def main() -> int:
    return kit.run(NAME, "openai", {"guess": play_guess}, openai.OpenAI, openai.OpenAIError)


if __name__ == "__main__":
    sys.exit(main())
