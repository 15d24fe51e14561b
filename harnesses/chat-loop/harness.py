"""chat-loop: the plainest harness. A chat loop with the openai SDK, history appended turn after turn.

Plays ``guess``: the model replies, the harness gives higher/lower feedback, up to ``max_turns`` turns; and
``say``: one call, its reply recorded as the turn and as ``final``.
Reads CLAWPIPE_TASK, talks to OPENAI_BASE_URL with CLAWPIPE_MODEL, writes CLAWPIPE_OUTPUT/transcript.json
after every turn (the reward is computed from it by the task set's verifier after this program exits).
Exit 0 on a finished game (garbage replies included), 1 when the model API fails, 2 on a bad task file.
"""

import os
import sys
from pathlib import Path

import openai

HERE = Path(__file__).resolve().parent
sys.path.insert(0, os.environ.get("CLAWPIPE_HARNESS_KIT") or str(HERE.parent / "_kit"))  # harnesses/_kit/README.md
import harness_kit as kit  # noqa: E402

NAME = "chat-loop"
SYSTEM = "You are playing a number guessing game."


def play_guess(client: openai.OpenAI, model: str, task: dict, rec: kit.Transcript) -> None:
    kw = kit.sampling(task, 16)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
    rec.data["status"] = "max_turns"
    for _ in range(int(task.get("max_turns", 4))):
        resp = client.chat.completions.create(model=model, messages=messages, **kw)
        rec.data["n_calls"] += 1
        reply = kit.chat_reply(resp)
        playing, feedback = kit.record_guess(rec, reply, task["data"])
        if not playing:
            break
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": feedback}]


def play_say(client: openai.OpenAI, model: str, task: dict, rec: kit.Transcript) -> None:
    messages = [{"role": "user", "content": task["prompt"]}]
    resp = client.chat.completions.create(model=model, messages=messages, **kit.sampling(task, 32))
    rec.data["n_calls"] += 1
    reply = kit.chat_reply(resp)
    rec.data["turns"].append({"reply": reply})
    rec.data.update(final=reply, status="done")


def main() -> int:
    return kit.run(NAME, "openai", {"guess": play_guess, "say": play_say}, openai.OpenAI, openai.OpenAIError)


if __name__ == "__main__":
    sys.exit(main())
