"""Attempts of a rollout batch: which id a rollout runs under on attempt N (``<id>.a<N>`` after the first,
so a cut-off attempt's calls never mix into the new one's tree), what an attempt keeps and reruns, and the
attempt counter kept on disk. Shared by the in-process rollout stage (clawpipe/pipeline/stages.py) and the
fanned-out one (clawpipe/pipeline/fanout.py)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def attempt_id(spec_id: str, attempt: int) -> str:
    """The rollout id of ``spec_id`` on attempt N of its batch: itself on the first, ``<id>.a<N>`` after."""
    return spec_id if attempt <= 1 else f"{spec_id}.a{attempt}"


def attempt_ids(spec_id: str, attempts: int) -> list[str]:
    """Every id ``spec_id`` may have run under in attempts 1..N, oldest first."""
    return [attempt_id(spec_id, a) for a in range(1, attempts + 1)]


def plan(
    spec_ids: Iterable[str], done: dict[str, dict[str, Any]], attempt: int
) -> tuple[dict[str, dict[str, Any]], list[tuple[str, str]]]:
    """What attempt ``attempt`` of a batch keeps and runs.

    ``done`` maps rollout ids to their final (non infra-error) result rows. A spec with a row under any of
    its earlier ids is kept (the latest such row); every other spec runs as ``attempt_id(id, attempt)``.
    Returns ({spec id: kept row}, [(spec id, id to run under)]).
    """
    kept: dict[str, dict[str, Any]] = {}
    todo: list[tuple[str, str]] = []
    for sid in spec_ids:
        finished = [done[i] for i in attempt_ids(sid, attempt) if i in done]
        if finished:
            kept[sid] = finished[-1]
        else:
            todo.append((sid, attempt_id(sid, attempt)))
    return kept, todo


class AttemptCounter:
    """A batch's attempt number, kept on disk so a retried task or a resumed run never reuses an id."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def current(self) -> int:
        return int(self.path.read_text()) if self.path.is_file() else 0

    def next(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        value = self.current + 1
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(str(value))
        os.replace(tmp, self.path)
        return value
