"""compacting-agent: rewrites its own history, so its calls branch instead of extending each other.

Plays ``guess`` with the openai SDK. Each prompt holds the system prompt, the task with a compact summary
of all turns but the last (e.g. "Notes: 6 -> Higher.; no number"), and only the last exchange verbatim
(a rolling window of one turn). So turn 2's prompt extends turn 1's, but turn 3's prompt does not extend
turn 2's: the user message changed when the oldest exchange was folded into the notes.
Reads CLAWPIPE_TASK, talks to OPENAI_BASE_URL with CLAWPIPE_MODEL, writes CLAWPIPE_OUTPUT/transcript.json
after every turn. Exit 0 on a finished game (garbage replies included), 1 when the model API fails, 2 on a
bad task file.
"""

import json
import os
import re
import sys
from pathlib import Path

import openai

NAME = "compacting-agent"
SYSTEM = "You are playing a number guessing game. Older turns are summarised in Notes."
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


def sampling(task: dict, default_max_tokens: int) -> dict:
    s = task.get("sampling") if isinstance(task.get("sampling"), dict) else {}
    kw = {"temperature": float(s.get("temperature", 1.0)), "max_tokens": int(s.get("max_tokens", default_max_tokens))}
    if "top_p" in s:
        kw["top_p"] = float(s["top_p"])
    return kw


def note(reply: str, feedback: str) -> str:
    """One older turn folded into a short note."""
    m = DIGITS.search(reply)
    return f"{m.group()[:9]} -> {feedback}" if m else "no number"


def build_prompt(task: dict, history: list[tuple[str, str]]) -> list[dict]:
    """System + task (+ notes on all turns but the last) + the last exchange verbatim."""
    messages = [{"role": "system", "content": SYSTEM}]
    if not history:
        return [*messages, {"role": "user", "content": task["prompt"]}]
    older, (reply, feedback) = history[:-1], history[-1]
    user = task["prompt"]
    if older:
        user += "\nNotes: " + "; ".join(note(r, f) for r, f in older)
    return [
        *messages,
        {"role": "user", "content": user},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": feedback},
    ]


def play_guess(client: openai.OpenAI, model: str, task: dict, rec: Transcript) -> None:
    kw = sampling(task, 16)
    history: list[tuple[str, str]] = []
    rec.data["status"] = "max_turns"
    for _ in range(int(task.get("max_turns", 4))):
        resp = client.chat.completions.create(model=model, messages=build_prompt(task, history), **kw)
        rec.data["n_calls"] += 1
        reply = (resp.choices[0].message.content or "") if resp.choices else ""
        outcome, feedback = judge(reply, task["data"])
        rec.data["turns"].append({"reply": reply, "feedback": feedback})
        rec.save()
        if outcome != "play":
            rec.data["status"] = outcome
            break
        history.append((reply, feedback))


def main() -> int:
    task = load_task()
    if task.get("task_set") != "guess":
        print(f"{NAME}: task set {task.get('task_set')!r} is not supported (only guess)", file=sys.stderr)
        return 2
    rec = Transcript(task)
    client = openai.OpenAI(
        base_url=os.environ.get("OPENAI_BASE_URL"),
        api_key=os.environ.get("OPENAI_API_KEY") or "none",
        max_retries=0,
        timeout=float(os.environ.get("CLAWPIPE_REQUEST_TIMEOUT") or 60),
    )
    model = os.environ.get("CLAWPIPE_MODEL") or os.environ.get("OPENAI_MODEL") or "default"
    try:
        play_guess(client, model, task, rec)
    except openai.OpenAIError as exc:
        rec.data.update(status="error", error=f"{type(exc).__name__}: {exc}"[:1000])
        rec.save()
        print(f"{NAME}: model API failed: {rec.data['error']}", file=sys.stderr)
        return 1
    rec.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
