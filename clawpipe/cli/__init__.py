"""The ``clawpipe`` command line.

Each room has its own module here (``clawpipe/cli/<room>.py``) exposing ``register(app)``; this module
registers the rooms that exist. Command modules import only typer at module level and their room's
heavy code inside the command body, so ``clawpipe --help`` stays fast.
"""

from __future__ import annotations

import errno
import importlib
import importlib.util
import logging
from pathlib import Path

import typer

ROOMS = ("serving", "proxy", "sandbox", "lake", "trees", "train", "pipeline")

app = typer.Typer(
    name="clawpipe",
    help="Train LLM agents with RL through the harnesses they run in.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at DEBUG level.")) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def check_run_id(value: str, flag: str) -> str:
    """A run id given on the command line: one lake partition's name (``run_id=<id>``), so never a path."""
    import re

    from clawpipe.capture import RUN_ID_MAX, SAFE_RUN_ID
    from clawpipe.errors import ConfigError

    if len(value) > RUN_ID_MAX or not re.match(SAFE_RUN_ID, value) or value.endswith("\n"):
        raise ConfigError(
            f"{flag} {value[:60]!r} is not a run id: give 1-{RUN_ID_MAX} letters, digits or ._:@+- "
            "starting with a letter or digit (no paths)"
        )
    return value


def _register_rooms() -> None:
    for room in ROOMS:
        name = f"clawpipe.cli.{room}"
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name).register(app)


_register_rooms()


def main() -> None:
    """Console-script entry point: turns ClawpipeError (and an OSError on a path) into a one-line message and
    exit code 2."""
    from clawpipe.errors import ClawpipeError

    try:
        app()
    except ClawpipeError as exc:
        typer.secho(f"error: {exc}", err=True, fg="red")
        raise SystemExit(2) from exc
    except OSError as exc:  # a path given that is a file, missing or not writable, met past a command's own checks
        logging.getLogger(__name__).debug("command failed", exc_info=True)
        typer.secho(f"error: {_path_problem(exc)}; check the path given (-v for details)", err=True, fg="red")
        raise SystemExit(2) from exc


def _path_problem(exc: OSError) -> str:
    """What went wrong with the path of ``exc``: a file standing where a folder is needed is named itself."""
    if exc.filename is None:
        return str(exc)
    path = Path(str(exc.filename))
    if exc.errno in (errno.EEXIST, errno.ENOTDIR):
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            return f"{blocker} is a file where a folder is needed"
    return f"{exc.strerror or exc}: {path}"
