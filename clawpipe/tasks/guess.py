"""``guess``: guess a hidden number from 1 to ``hi`` in at most 4 turns, with higher/lower feedback.

Built for the tiny random policy to learn on CPU within minutes. Parsing is lenient (the first run of
digits anywhere in a reply is the guess), and a reply without an in-range number ENDS the game. So the
reward grows faster than the rate of replies that hold a number, which GRPO raises quickly (an
unconditional habit); starting the reply with the number earns full credit (buried: BURIED_FACTOR), and
hitting the number early (a search using the feedback) earns the most.
Figures (4 turns, range 1..8-12, 16-token replies): uniform-random tokens of the tiny policy's tokenizer
~0.04-0.08 (the rate of digit tokens in the vocabulary sets it: 12 of 512 -> 0.04, 24 -> 0.08); always a
leading random number ~0.64; binary search ~0.83; never a number 0. A minimal on-policy GRPO loop (8
groups x 4, Adam 3e-3, entropy bonus 0.02, advantage = reward - group mean) on the tiny policy with
chat-loop's prompts went 0.035 -> ~0.1 in 6 iterations and ~0.2 by 26 (about a minute of CPU).

Rules a harness implements (it plays the environment; the verifier recomputes everything from the replies):
each turn the model replies; the guess is the first ``[0-9]+`` in the reply; feedback is "Higher." (guess
below the number), "Lower." (above), "Correct!" (ends the game); a reply without a number from LO to HI
ends the game (record the turn, feedback "No number from LO to HI. Game over."). At most ``max_turns``
turns.

Transcript contract (``out/transcript.json``: a regular file, one plain JSON object, at most 4 MiB and 64
levels, no NaN or duplicate keys; anything else is reward 0 with a reason):

- ``turns``: a list with ONE ENTRY PER MODEL CALL of the game, in order. An entry is an object
  ``{"reply": <the model's text, a string>}`` plus ``"answer": <string>`` when the guess came from
  elsewhere than the text (the ``number`` argument of a ``guess`` tool call; tool-agent does this).
- The turn's guess is read from ``answer`` when it is a string, else from ``reply``: the first run of
  ASCII digits. A non-string is read as "" (no guess: game over).
- Ignored: entries that are not objects, every other key (``feedback``, ``tool_calls``, ``reward``...),
  turns past ``max_turns``, turns after the game ended (a hit, or a turn without an in-range guess), and
  the top-level ``final`` and status fields.

Reward: the mean over ``max_turns`` turn scores. A turn with an in-range guess scores 1 for a hit
(and the remaining turns keep that score: the game is won), MISS_BASE + MISS_CLOSENESS * (1 - |guess -
target| / (hi - lo)) for a miss, each times BURIED_FACTOR when the reply does not start with the guess.
The first turn without an in-range guess scores 0 and ends the game (later turns are ignored).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from clawpipe.tasks.base import as_text, data_view, read_transcript, sample_keys, transcript_turns

NAME = "guess"
LO = 1
HI_CHOICES = (8, 9, 10, 11, 12)
MAX_TURNS = 4
SAMPLING = {"temperature": 1.0, "max_tokens": 16}
MISS_BASE = 0.4
MISS_CLOSENESS = 0.3
BURIED_FACTOR = 0.5
_DIGITS = re.compile(r"[0-9]+")
# The harness plays the game in the sandbox (harnesses/_kit judges each guess), so it needs the target.
HARNESS_DATA = ("lo", "hi", "target")


def opaque_id(key: str) -> str:
    """The task id of instance ``key`` ("hi-target", maybe with a "~k" repeat suffix): a hash of it, since
    the id reaches the sandbox (task file, proxy key, transcript) and must not name the target."""
    return f"{NAME}-{hashlib.sha256(f'{NAME}:{key}'.encode()).hexdigest()[:12]}"


def parse_guess(reply: str) -> tuple[int | None, bool]:
    """(first integer in ``reply`` or None, whether the reply starts with it after whitespace)."""
    m = _DIGITS.search(reply)
    if m is None:
        return None, False
    leading = reply[: m.start()].strip() == ""
    return int(m.group()[:9]), leading


def turn_score(guess: int | None, leading: bool, *, lo: int, hi: int, target: int) -> float:
    """One turn's score: 0 without an in-range guess; a hit 1; a miss MISS_BASE + MISS_CLOSENESS * closeness."""
    if guess is None or not lo <= guess <= hi:
        return 0.0
    factor = 1.0 if leading else BURIED_FACTOR
    if guess == target:
        return factor
    return factor * (MISS_BASE + MISS_CLOSENESS * (1.0 - abs(guess - target) / (hi - lo)))


def score_guesses(answers: list[str], *, lo: int, hi: int, target: int, max_turns: int) -> tuple[float, dict[str, Any]]:
    """Reward and info for the replies of one game (see the module docstring for the formula)."""
    scores: list[float] = []
    guesses: list[int | None] = []
    solved_turn: int | None = None
    n_valid = n_leading = 0
    for t, answer in enumerate(answers[:max_turns]):
        guess, leading = parse_guess(answer)
        guesses.append(guess)
        scores.append(turn_score(guess, leading, lo=lo, hi=hi, target=target))
        if guess is None or not lo <= guess <= hi:
            break  # the game is lost
        n_valid += 1
        n_leading += leading
        if guess == target:
            solved_turn = t
            scores += [scores[-1]] * (max_turns - len(scores))  # the game is over: a hit keeps its score
            break
    reward = sum(scores) / max_turns if max_turns > 0 else 0.0
    info = {
        "guesses": guesses,
        "target": target,
        "solved": solved_turn is not None,
        "solved_turn": solved_turn,
        "n_turns": len(guesses),
        "n_valid": n_valid,
        "n_leading": n_leading,
    }
    return reward, info


class GuessTaskSet:
    """Guess-a-number with higher/lower feedback (multi-turn; learnable by the tiny policy)."""

    name = NAME

    def generate(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        """``n`` games; an instance is (hi, target), assigned to train or eval by a stable hash."""

        def draw(rng: Any) -> str:
            hi = rng.choice(HI_CHOICES)
            return f"{hi}-{rng.randint(LO, hi)}"

        tasks = []
        for key in sample_keys(NAME, n, seed, split, draw):
            hi, target = (int(x) for x in key.split("~")[0].split("-"))
            tasks.append(
                {
                    "task_set": NAME,
                    "task_id": opaque_id(key),
                    "prompt": f"Guess my number from {LO} to {hi}. Reply with just the number. "
                    "I will say higher or lower.",
                    "data": {"lo": LO, "hi": hi, "target": target},
                    "max_turns": MAX_TURNS,
                    "sampling": dict(SAMPLING),
                }
            )
        return tasks

    def harness_task(self, task: dict[str, Any]) -> dict[str, Any]:
        """The task with the game's range and target, which the harness judges guesses with."""
        return data_view(task, HARNESS_DATA)

    def prepare(self, task: dict[str, Any], workdir: Path) -> None:
        """Nothing to write: the harness plays the game from the task file."""

    def verify(self, task: dict[str, Any], workdir: Path) -> tuple[float, dict[str, Any]]:
        """Reward from the replies in ``out/transcript.json``; 0 with a reason when it is missing or garbage."""
        try:
            data = task["data"]
            lo, hi, target = int(data["lo"]), int(data["hi"]), int(data["target"])
            max_turns = int(task.get("max_turns", MAX_TURNS))
        except (KeyError, TypeError, ValueError) as exc:
            return 0.0, {"reason": f"task instance lacks lo/hi/target: {exc}"}
        transcript, reason = read_transcript(workdir)
        if transcript is None:
            return 0.0, {"reason": reason}
        answers = []
        for turn in transcript_turns(transcript):
            answer = turn.get("answer") if isinstance(turn.get("answer"), str) else turn.get("reply")
            answers.append(as_text(answer))
        reward, info = score_guesses(answers, lo=lo, hi=hi, target=target, max_turns=max_turns)
        if not answers:
            info["reason"] = "the transcript has no turns"
        elif info["n_valid"] == 0:
            info["reason"] = f"no reply held a number from {lo} to {hi}"
        return reward, info
