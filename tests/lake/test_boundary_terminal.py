"""What the lake holds comes from harnesses and the policy: ``clawpipe sql``'s table format and its error
messages never hand an escape sequence, a carriage return or a bidirectional override to the reader's terminal;
they are shown as escapes. JSON lines escape them as JSON does; CSV carries the data unchanged."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from clawpipe.cli import app
from clawpipe.lake import land
from tests.lake import fixtures as fx

HOSTILE = "ok\x1b]52;c;cHduZWQ=\x07\x1b[2J\rfake line\u202etxt.exe\x9b31m"


def _lake(home: Path) -> None:
    cap = home / "captures"
    fx.write_segment(cap / "p-000001.seg", [fx.record("chat", False, rollout_id="r0", seq=0, call_id="c0")])
    fx.write_results(cap, [fx.rollout_row("r0", stderr_tail=HOSTILE, error=HOSTILE)])
    land(cap, home / "lake")


def test_the_table_format_shows_control_characters_as_escapes(home: Path) -> None:
    _lake(home)
    out = CliRunner().invoke(app, ["sql", 'select stderr_tail, error as "x\x1b[1m" from rollouts'])
    assert out.exit_code == 0, out.output
    assert not any(c in out.output for c in "\x1b\x07\r\u202e\x9b")
    assert "ok\\x1b]52;c;cHduZWQ=\\x07\\x1b[2J\\x0dfake line\\u202etxt.exe" in out.output  # cut at 60
    assert out.output.splitlines()[0].startswith("stderr_tail") and "x\\x1b[1m" in out.output.splitlines()[0]


def test_error_messages_quoting_the_data_show_it_as_escapes(home: Path) -> None:
    _lake(home)
    bad = CliRunner().invoke(app, ["sql", "select cast(stderr_tail as int) from rollouts"])
    assert bad.exit_code == 1 and "Conversion Error" in bad.output
    assert not any(c in bad.output for c in "\x1b\x07\r\u202e") and "\\x1b" in bad.output


def test_json_lines_escape_and_csv_keeps_the_data(home: Path, tmp_path: Path) -> None:
    _lake(home)
    js = CliRunner().invoke(app, ["sql", "select stderr_tail from rollouts", "--format", "json"])
    assert "\x1b" not in js.output and json.loads(js.output.splitlines()[0])["stderr_tail"] == HOSTILE
    target = tmp_path / "out.csv"
    CliRunner().invoke(app, ["sql", "select stderr_tail from rollouts", "--format", "csv", "--out", str(target)])
    with open(target, newline="") as f:  # csv quotes the field: its carriage return stays in it
        assert HOSTILE in f.read()
