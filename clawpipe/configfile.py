"""Config files in and out: read a TOML or JSON file into a validated model, and hand a model to a child.

Every config that crosses a process boundary (``clawpipe run`` -> the pipeline flow, the pipeline -> the
trainer, ``clawpipe deploy`` -> the deployment) goes the same way: the parent validates it once, writes
it with :func:`write_config` as JSON, and the child reads it back with :func:`read_config` into the same
model class. Users write TOML; both formats are read by the same function, chosen by the file suffix.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from clawpipe.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


def read_values(path: str | Path, *, what: str, table: str | None = None) -> dict[str, Any]:
    """The top-level values of a TOML or JSON file (or of its ``[table]`` when present)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {p} does not exist; pass an existing TOML or JSON file")
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        kind = "JSON" if p.suffix == ".json" else "TOML"
        raise ConfigError(f"{what} {p} is not valid {kind}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {p} must hold a table of settings, not {type(data).__name__}")
    if table is not None and isinstance(data.get(table), dict):
        data = data[table]
    return dict(data)


def describe(exc: ValidationError, what: str) -> str:
    """A one-line message naming each invalid field and why."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(x) for x in err["loc"]) or "(config)"
        parts.append(f"{where}: {err['msg']}")
    return f"invalid {what}: " + "; ".join(parts)


def validate(cls: type[M], values: dict[str, Any], *, what: str) -> M:
    """``cls`` built from ``values``; a ConfigError naming each bad field otherwise."""
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(describe(exc, what)) from None


def write_config(model: BaseModel, path: str | Path) -> Path:
    """Write ``model`` as JSON, atomically, for a child process to read with :func:`read_config`."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(model.model_dump_json(indent=2))
    os.replace(tmp, p)
    return p


def read_config(cls: type[M], path: str | Path, *, what: str = "config") -> M:
    """The model a parent wrote with :func:`write_config` (or a user's TOML/JSON file), validated."""
    return validate(cls, read_values(path, what=what), what=f"{what} ({path})")
