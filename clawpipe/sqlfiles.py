"""The one loader of SQL files under sql/ (one statement or view per file, DuckDB ``$name`` parameters).

A file may open with ``-- include: <name>`` lines (``<name>`` as :func:`sql_text` takes it, e.g.
``common/latest_rollouts``): each included statement becomes a CTE named after the file (``latest_rollouts``)
in front of the including statement, so a query that several files share is written once and every file
still reads as one plain statement with its parameters.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from clawpipe.errors import LakeError

SQL_DIR = Path(__file__).resolve().parent.parent / "sql"

_INCLUDE = re.compile(r"^--\s*include:\s*(\S+)\s*$")
_WITH = re.compile(r"^with\s", re.IGNORECASE)


@functools.cache
def sql_text(name: str) -> str:
    """Text of ``sql/<name>.sql`` (name may contain a folder, e.g. ``views/model_calls``), with its includes."""
    return _expand(name, ())


def sql_names(folder: str) -> list[str]:
    """Names (without .sql) of the files in ``sql/<folder>/``, sorted."""
    return sorted(p.stem for p in (SQL_DIR / folder).glob("*.sql"))


def _read(name: str) -> str:
    path = SQL_DIR / f"{name}.sql"
    if not path.is_file():
        raise LakeError(f"no SQL file {path}; saved queries live in {SQL_DIR}")
    return path.read_text()


def _expand(name: str, including: tuple[str, ...]) -> str:
    if name in including:
        raise LakeError(f"SQL include cycle: {' -> '.join((*including, name))}; remove one of these includes")
    text = _read(name)
    lines = text.splitlines(keepends=True)
    head: list[str] = []  # the leading comment block, kept on top so the file still explains itself
    includes: list[str] = []
    while lines and (lines[0].startswith("--") or not lines[0].strip()):
        line = lines.pop(0)
        m = _INCLUDE.match(line.strip())
        if m:
            includes.append(m.group(1))
        head.append(line)
    if not includes:
        return text
    body = "".join(lines)
    ctes = [f"{Path(inc).name} as (\n{_statement(_expand(inc, (*including, name)))}\n)" for inc in includes]
    if _WITH.match(body):
        # The file has CTEs of its own: the included ones go first, so the file's CTEs may read them.
        return "".join(head) + "with " + ",\n\n".join(ctes) + ",\n\n" + _WITH.sub("", body, count=1)
    return "".join(head) + "with " + ",\n\n".join(ctes) + "\n\n" + body


def _statement(sql: str) -> str:
    """``sql`` without its comment lines and trailing semicolon, to sit inside a CTE's parentheses."""
    kept = [line for line in sql.splitlines() if not line.lstrip().startswith("--")]
    return "\n".join(kept).strip().rstrip(";")
