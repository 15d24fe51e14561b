"""compacting-agent: rewrites its own history, so its calls branch instead of extending each other.

Plays ``guess`` with the openai SDK. Each prompt holds the system prompt, the task with a compact summary
of all turns but the last (e.g. "Notes: 6 -> Higher.; no number"), and only the last exchange verbatim
(a rolling window of one turn). So turn 2's prompt extends turn 1's, but turn 3's prompt does not extend
turn 2's: the user message changed when the oldest exchange was folded into the notes.
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

NAME = "compacting-agent"
SYSTEM = "You are playing a number guessing game. Older turns are summarised in Notes."


def build_prompt(task: dict, history: list[tuple[str, str]]) -> list[dict]:
    """System + task (+ notes on all turns but the last) + the last exchange verbatim."""
    messages = [{"role": "system", "content": SYSTEM}]
    if not history:
        return [*messages, {"role": "user", "content": task["prompt"]}]
    older, (reply, feedback) = history[:-1], history[-1]
    user = task["prompt"]
    if older:
        user += "\nNotes: " + "; ".join(kit.note(r, f) for r, f in older)
    return [
        *messages,
        {"role": "user", "content": user},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": feedback},
    ]


def play_guess(client: openai.OpenAI, model: str, task: dict, rec: kit.Transcript) -> None:
    kw = kit.sampling(task, 16)
    history: list[tuple[str, str]] = []
    rec.data["status"] = "max_turns"
    for _ in range(int(task.get("max_turns", 4))):
        resp = client.chat.completions.create(model=model, messages=build_prompt(task, history), **kw)
        rec.data["n_calls"] += 1
        reply = kit.chat_reply(resp)
        playing, feedback = kit.record_guess(rec, reply, task["data"])
        if not playing:
            break
        history.append((reply, feedback))


def main() -> int:
    return kit.run(NAME, "openai", {"guess": play_guess}, openai.OpenAI, openai.OpenAIError)


if __name__ == "__main__":
    sys.exit(main())
