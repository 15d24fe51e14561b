"""Config files in and out: read a TOML or JSON file into a validated model, and hand a model to a child.

Every config that crosses a process boundary (``clawpipe run`` -> the pipeline flow, the pipeline -> the
trainer, ``clawpipe deploy`` -> the deployment) goes the same way: the parent validates it once, writes
it with :func:`write_config` as JSON, and the child reads it back with :func:`read_config` into the same
model class. Users write TOML; both formats are read by the same function, chosen by the file suffix.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from pathlib import Path
from typing import Any, TypeVar, get_args

from pydantic import BaseModel, ValidationError

from clawpipe.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


def read_values(path: str | Path, *, what: str, table: str | None = None) -> dict[str, Any]:
    """The top-level values of a TOML or JSON file (or of its ``[table]`` when present)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{what} {p} is a folder; pass a TOML or JSON file")
    if not p.is_file():
        raise ConfigError(f"{what} {p} does not exist; pass an existing TOML or JSON file")
    if p.suffix.lower() in (".yaml", ".yml"):  # it would otherwise be parsed as TOML and fail on its first line
        raise ConfigError(f"{what} {p} is YAML, which clawpipe does not read; write it as TOML (key = value) or JSON")
    try:
        text = p.read_text(encoding="utf-8")  # TOML is UTF-8 by definition, whatever the locale says
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {p} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        kind = "JSON" if p.suffix == ".json" else "TOML"
        where = f" (the file ends at line {text.count(chr(10)) + 1}: a value or bracket is left open)"
        end = "end of document" in str(exc)  # tomllib gives no line there
        raise ConfigError(f"{what} {p} is not valid {kind}: {exc}{where if end else ''}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {p} must hold a table of settings, not {type(data).__name__}")
    if table is not None and isinstance(data.get(table), dict):
        data = data[table]
    return dict(data)


def describe(
    exc: ValidationError,
    what: str,
    cls: type[BaseModel] | None = None,
    tables: dict[str, type[BaseModel]] | None = None,
) -> str:
    """A one-line message naming each invalid field, the value given and why; an unknown key is listed with
    the keys its table takes (found through ``cls``, the model validated), and with a key of a table below
    it that it is close to (``tables``: models of top-level tables validated apart, e.g. ``train``)."""
    parts = []
    for err in exc.errors():
        loc = err["loc"]
        where = ".".join(str(x) for x in loc)
        msg = err["msg"].removeprefix("Value error, ")  # our own validators' messages name the value already
        if err["type"] == "extra_forbidden":
            known = _keys_at(cls, loc[:-1]) if cls is not None else []
            close = difflib.get_close_matches(str(loc[-1]), known, n=1) if loc else []
            if not close and cls is not None and loc:  # a key of a table below, written at this level
                close = _nested_matches(cls, loc[:-1], str(loc[-1]), tables if len(loc) == 1 else None)
            msg = "unknown key" + (f" (did you mean {close[0]}?)" if close else "")
            msg += f"; the keys here are {', '.join(known)}" if known else "; check its spelling"
        elif err["type"] != "value_error" and not isinstance(err.get("input"), dict | list):
            msg += f" (got {shown(err.get('input'))})"
        parts.append(f"{where}: {msg}" if where else msg)
    return f"invalid {what}: " + "; ".join(parts)


def shown(value: Any, width: int = 60) -> str:
    """``value`` as an error message quotes it: its repr, cut to ``width`` characters."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _keys_at(cls: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The field names of the (nested) model at ``loc`` inside ``cls``: [] where ``loc`` is not a model."""
    model: Any = cls
    for part in loc:
        if isinstance(part, int):
            continue  # an item of a list of models
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return []
        model = next((a for a in (field.annotation, *get_args(field.annotation)) if _is_model(a)), None)
    return sorted(model.model_fields) if _is_model(model) else []


def _nested_matches(
    cls: type[BaseModel], loc: tuple[int | str, ...], key: str, tables: dict[str, type[BaseModel]] | None
) -> list[str]:
    """``table.key`` names close to ``key`` among the keys of the tables one level below ``loc``."""
    found = []
    for table in _keys_at(cls, loc):
        inner = sorted((tables or {})[table].model_fields) if table in (tables or {}) else _keys_at(cls, (*loc, table))
        found += [f"{table}.{k}, in the {table} table" for k in difflib.get_close_matches(key, inner, n=1)]
    return found[:1]


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def validate(cls: type[M], values: dict[str, Any], *, what: str, tables: dict[str, type[BaseModel]] | None = None) -> M:
    """``cls`` built from ``values``; a ConfigError naming each bad field otherwise (see :func:`describe`)."""
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(describe(exc, what, cls, tables)) from None


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
