"""Command-line numbers out of their range are refused while the arguments are parsed, naming the flag,
before any server binds or any lake is touched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clawpipe.cli import app

ROOT = Path(__file__).resolve().parents[2]


def _flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())  # the usage box wraps long lines


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        # a port past 65535 was taken modulo 65536: the proxy listened on 4464 for --port 70000
        (["proxy", "--upstream", "http://127.0.0.1:9", "--port", "70000"], "--port"),
        (["proxy", "--upstream", "http://127.0.0.1:9", "--port", "-1"], "--port"),
        (["serve", "--model", "/nonexistent", "--port", "70000"], "--port"),
        # a segment of no size, or no age, would rotate on every call
        (["proxy", "--upstream", "http://127.0.0.1:9", "--port", "0", "--segment-mb", "-1"], "--segment-mb"),
        (["proxy", "--upstream", "http://127.0.0.1:9", "--port", "0", "--segment-age", "nan"], "--segment-age"),
        (["proxy", "--upstream", "http://127.0.0.1:9", "--port", "0", "--segment-age", "0"], "--segment-age"),
        # the proxy's limits were named by their settings' fields ("proxy settings ['max_body_bytes'] ...")
        (["proxy", "--upstream", "http://127.0.0.1:9", "--port", "0", "--max-body-mb", "-1"], "--max-body-mb"),
        (["proxy", "--upstream", "http://127.0.0.1:9", "--port", "0", "--max-connections", "0"], "--max-connections"),
        (["proxy", "--upstream", "http://127.0.0.1:9", "--port", "0", "--upstream-timeout", "0"], "--upstream-timeout"),
    ],
)
def test_servers_refuse_out_of_range_numbers_before_binding(tmp_path: Path, args: list[str], flag: str) -> None:
    env = {**os.environ, "CLAWPIPE_HOME": str(tmp_path / "home")}
    # a subprocess with a deadline: a server that accepted the value would listen until killed
    out = subprocess.run(
        [sys.executable, "-m", "clawpipe", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    message = _flat(out.stderr)
    assert out.returncode == 2, message
    assert flag in message and "listening" not in message
    assert not (tmp_path / "home" / "captures").exists()


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["lake", "compact", "--min-files", "0"], "--min-files"),
        (["lake", "compact", "--min-files", "-5"], "--min-files"),
        (["lake", "check", "--show", "-1"], "--show"),
        (["worker", "--limit", "0"], "--limit"),
    ],
)
def test_lake_and_worker_commands_refuse_out_of_range_numbers(home: Path, args: list[str], flag: str) -> None:
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert flag in _flat(res.output) and "greater than or equal to" in _flat(res.output)
    assert not home.exists()  # nothing ran: no lake, no worker state


@pytest.mark.parametrize("run_id", ["../../elsewhere", "/tmp/x", "..", ".hidden", "a b", "run\n", "r" * 201, ""])
@pytest.mark.parametrize(
    "command",
    [
        ["train", "--iteration", "0", "--run"],
        ["rollout", "--harness", "chat-loop", "--tasks", "guess", "--backend", "process", "--run-id"],
    ],
)
def test_a_run_id_on_the_command_line_is_a_partition_name_not_a_path(
    home: Path, command: list[str], run_id: str
) -> None:
    from clawpipe.errors import ConfigError

    res = CliRunner().invoke(app, [*command, run_id])
    assert isinstance(res.exception, ConfigError), (res.exception, res.output)
    assert f"{command[-1]} {run_id[:60]!r} is not a run id" in str(res.exception) and "no paths" in str(res.exception)
    assert not home.exists()  # no models folder, no captures, no results
