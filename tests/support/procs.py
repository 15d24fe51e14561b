"""Process trees read from /proc, safe against processes that end while they are read."""

from __future__ import annotations

import os


def children(pid: int) -> list[int]:
    """Children of every thread of ``pid`` (sandboxes are started from a runner's threads); none once it ended."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:  # the process ended (or was never there) between being listed and being read
        return []
    found = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                found += [int(c) for c in fh.read().split()]
        except OSError:  # that thread ended meanwhile
            continue
    return found


def descendants(pid: int) -> list[int]:
    """Every process under ``pid``, recursively, as far as they still exist while they are read."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found
