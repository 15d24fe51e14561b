"""``clawpipe harness check NAME --transcript sample.json`` as the README's harness section has a user run it:
each task set's contract is stated whole, not cut at the end of its docstring's first line."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from clawpipe.cli import app


def test_transcript_check_states_each_contracts_first_paragraph_whole(tmp_path: Path) -> None:
    sample = tmp_path / "sample.json"
    sample.write_text(json.dumps({"turns": [{"reply": "6"}, {"reply": "9"}], "final": "9"}))
    res = CliRunner().invoke(app, ["harness", "check", "chat-loop", "--transcript", str(sample)])
    assert res.exit_code == 0, res.output
    lines = {line.split(":", 1)[0].strip(): line for line in res.output.splitlines() if "transcript vs" in line}
    assert set(lines) == {"transcript vs guess", "transcript vs say"}
    # the guess contract's first paragraph runs over two docstring lines: both halves on the one line shown
    assert (
        "at most 4 MiB and 64 levels, no NaN or duplicate keys; anything else is reward 0"
        in lines["transcript vs guess"]
    )
    assert lines["transcript vs say"].rstrip().endswith("scores 0 with the reason.")
