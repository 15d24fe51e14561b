"""The one loader of SQL files under sql/ (one statement or view per file, DuckDB ``$name`` parameters)."""

from __future__ import annotations

import functools
from pathlib import Path

from clawpipe.errors import LakeError

SQL_DIR = Path(__file__).resolve().parent.parent / "sql"


@functools.cache
def sql_text(name: str) -> str:
    """Text of ``sql/<name>.sql`` (name may contain a folder, e.g. ``views/model_calls``)."""
    path = SQL_DIR / f"{name}.sql"
    if not path.is_file():
        raise LakeError(f"no SQL file {path}; saved queries live in {SQL_DIR}")
    return path.read_text()


def sql_names(folder: str) -> list[str]:
    """Names (without .sql) of the files in ``sql/<folder>/``, sorted."""
    return sorted(p.stem for p in (SQL_DIR / folder).glob("*.sql"))
