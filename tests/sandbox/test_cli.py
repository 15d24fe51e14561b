"""`clawpipe rollout` and `clawpipe harness list|check` through the real CLI app."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clawpipe.capture import read_results
from clawpipe.cli import app
from clawpipe.errors import ManifestError
from tests.sandbox.support import URLLIB_HARNESS, EchoTaskSet, Upstream, make_harness

TASK = {"task_set": "echo", "task_id": "t1", "prompt": "say 42", "data": {"answer": "42"}, "max_turns": 1}


def test_harness_list_and_check(tmp_path: Path) -> None:
    make_harness(tmp_path, "mine", "pass\n", description="my harness")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "harness.toml").write_text('name = "broken"\n')
    runner = CliRunner()
    out = runner.invoke(app, ["harness", "list", "--harness-dir", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert "mine" in out.output and "my harness" in out.output
    assert "broken" in out.output and "INVALID" in out.output and "missing required key `command`" in out.output
    out = runner.invoke(app, ["harness", "check", "mine", "--harness-dir", str(tmp_path)])
    assert out.exit_code == 0 and "python3 /harness/main.py" in out.output


def test_rollout_from_a_task_file(
    tmp_path: Path, upstream: Upstream, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import clawpipe.tasks

    # the runner finds the task set by the instance's task_set name
    monkeypatch.setitem(clawpipe.tasks._REGISTRY, "echo", EchoTaskSet())
    make_harness(tmp_path, "chatty", URLLIB_HARNESS)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(TASK) + "\n" + json.dumps({**TASK, "task_id": "t2"}) + "\n")
    results = tmp_path / "results.jsonl"
    args = ["rollout", "--harness", "chatty", "--harness-dir", str(tmp_path), "--task-file", str(tasks)]
    args += ["--samples", "2", "--backend", "process", "--proxy", upstream.url, "--results", str(results)]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    assert "4 rollouts: succeeded=4; mean reward 1.000; masked groups 0" in out.output
    rows = [row for _, row, _ in read_results(results)]
    batches = {r["group_id"].rsplit(".chatty.", 1)[0] for r in rows}
    assert len(batches) == 1  # one invocation, one batch: <batch>.<harness>.<task>
    tail = sorted((r["group_id"].rsplit(".", 1)[1], r["sample_idx"]) for r in rows)
    assert tail == [("t1", 0), ("t1", 1), ("t2", 0), ("t2", 1)]
    out = CliRunner().invoke(app, args)  # the same tasks again, same run id: new rollout ids
    assert out.exit_code == 0, out.output
    again = [row["rollout_id"] for _, row, _ in read_results(results)]
    assert len(again) == 8 and len(set(again)) == 8

    tasks.write_text(json.dumps(TASK) + "\n" + '{"task_set": "echo", "task_id": 5}\n')
    before = len(upstream.calls)
    out = CliRunner().invoke(app, args)
    assert isinstance(out.exception, ManifestError)
    assert "tasks.jsonl:2" in str(out.exception) and len(upstream.calls) == before
