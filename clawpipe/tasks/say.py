"""``say``: reply with a given short phrase and nothing else; partial credit for a reply close to it.

Made for harnesses whose only trace is their final reply, such as the real agent CLIs (their launcher
writes the CLI's last reply as ``final``; harnesses/REAL_HARNESSES.md). The reward is graded, so rollouts of
one group differ in reward even for a policy that has learned nothing yet (an untrained policy's garbage
replies score small but distinct similarities): GRPO gets a signal from the first iteration.

Transcript contract: ``final`` only, the harness's last reply to the user (a string). ``turns``, ``answer``
and ``reply`` are ignored; a missing or non-string ``final`` scores 0 with the reason.

Reward: 1.0 when the reply, lower-cased with whitespace collapsed and surrounding quotes and punctuation
stripped, equals the phrase; otherwise the similarity of the two (difflib's ratio: twice the matching
characters over both lengths), which is below 1. ``reward_info``: ``similarity``, ``exact``, ``reply_chars``.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

from clawpipe.tasks.base import data_view, read_transcript, sample_keys

NAME = "say"
MAX_TURNS = 4
SAMPLING = {"temperature": 1.0, "max_tokens": 32}
MAX_REPLY_CHARS = 4000  # a reply is compared up to here: a longer one is no closer to a two-word phrase
WORDS = (
    "amber", "blue", "cedar", "delta", "ember", "fjord", "grape", "harbor", "ivory", "jade",
    "kelp", "lemon", "maple", "north", "olive", "pearl", "quartz", "river", "slate", "tulip",
)  # fmt: skip
_EDGE = " \t\n\"'`.,;:!?*_()[]{}<>"


def normalize(text: str) -> str:
    """Lower case, whitespace collapsed, quotes and punctuation stripped at both ends."""
    return re.sub(r"\s+", " ", text.lower()).strip(_EDGE)


def similarity(reply: str, phrase: str) -> float:
    """How close the normalized reply is to the phrase: 1.0 only when equal, else difflib's ratio."""
    got, want = normalize(reply[:MAX_REPLY_CHARS]), normalize(phrase)
    if got == want:
        return 1.0
    # The phrase is the second sequence: difflib's junk heuristic then never applies to it (it is short).
    return min(difflib.SequenceMatcher(None, got, want, autojunk=False).ratio(), 0.999)


class SayTaskSet:
    """Say a two-word phrase; graded by how close the final reply comes (for CLI agents and CI runs)."""

    name = NAME
    transcript_fields = ("final",)  # what `clawpipe harness check --transcript` requires of a sample

    def generate(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        """``n`` instances; an instance is an ordered pair of distinct words, its split a stable hash."""

        def draw(rng: Any) -> str:
            first, second = rng.sample(WORDS, 2)
            return f"{first}-{second}"

        tasks = []
        for key in sample_keys(NAME, n, seed, split, draw):
            phrase = key.split("~")[0].replace("-", " ")
            tasks.append(
                {
                    "task_set": NAME,
                    "task_id": f"{NAME}-{key}",
                    "prompt": f"Reply with exactly these two words and nothing else: {phrase}",
                    "data": {"phrase": phrase},
                    "max_turns": MAX_TURNS,
                    "sampling": dict(SAMPLING),
                }
            )
        return tasks

    def harness_task(self, task: dict[str, Any]) -> dict[str, Any]:
        """The task without its data: the prompt says the phrase, and nothing else is the harness's to know."""
        return data_view(task, ())

    def prepare(self, task: dict[str, Any], workdir: Path) -> None:
        """Nothing to write: the task is the prompt."""

    def verify(self, task: dict[str, Any], workdir: Path) -> tuple[float, dict[str, Any]]:
        """The similarity of the transcript's ``final`` to the task's phrase (0 with a reason without one)."""
        transcript, reason = read_transcript(workdir)
        if transcript is None:
            return 0.0, {"reason": reason}
        final = transcript.get("final")
        if not isinstance(final, str):
            return 0.0, {"reason": "the transcript has no `final` string (the harness's last reply)"}
        score = similarity(final, str(task["data"]["phrase"]))
        return score, {"similarity": round(score, 4), "exact": score == 1.0, "reply_chars": len(final)}
