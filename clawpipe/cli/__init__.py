"""The ``clawpipe`` command line.

Each room has its own module here (``clawpipe/cli/<room>.py``) exposing ``register(app)``; this module
registers the rooms that exist. Command modules import only typer at module level and their room's
heavy code inside the command body, so ``clawpipe --help`` stays fast.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

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


def _register_rooms() -> None:
    for room in ROOMS:
        name = f"clawpipe.cli.{room}"
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name).register(app)


_register_rooms()


def main() -> None:
    """Console-script entry point: turns ClawpipeError into a one-line message and exit code 2."""
    from clawpipe.errors import ClawpipeError

    try:
        app()
    except ClawpipeError as exc:
        typer.secho(f"error: {exc}", err=True, fg="red")
        raise SystemExit(2) from exc
