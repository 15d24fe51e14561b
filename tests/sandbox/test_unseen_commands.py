"""Harness commands that cannot start: a bare program not on the sandbox's PATH, an interpreter's script missing
from the harness folder, a program without its executable bit. Each used to run every rollout to a ``failed``
status (the exec failed inside the sandbox; the verifier scored an empty work dir); now the batch fails before
any sandbox starts, naming the command and what to do, and ``clawpipe harness check`` says so with exit 1.
Commands that can start (options before the script, ``-m``/``-c``, an executable in the folder) still run."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from clawpipe.cli import app
from clawpipe.errors import ManifestError
from clawpipe.sandbox import load_manifest
from tests.sandbox.support import EchoTaskSet, Upstream, make_harness
from tests.sandbox.test_runner import run, specs_for

ANSWER = "import os\nopen(os.path.join(os.environ['CLAWPIPE_OUTPUT'], 'answer.txt'), 'w').write('42')\n"
CANNOT_START = [
    (["nosuchprog", "main.py"], r"program 'nosuchprog' is not on the sandbox's PATH .*/usr/bin.*write ./nosuchprog"),
    (["python3", "missing.py"], r"python3 would run 'missing.py', which is not a file in"),
    (["python3", "-u", "-X", "utf8", "missing.py"], r"python3 would run 'missing.py'"),
    (["node", "/no/such/agent.js"], r"node would run '/no/such/agent.js', which does not exist"),
    (["./main.py"], r"program '.*/main.py' is not executable \(chmod \+x it\)"),
]


@pytest.mark.sandbox
@pytest.mark.parametrize(("command", "why"), CANNOT_START, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_a_command_that_cannot_start_fails_the_batch_before_any_sandbox(
    tmp_path: Path, upstream: Upstream, echo: EchoTaskSet, command: list[str], why: str
) -> None:
    folder = make_harness(tmp_path, "broken", ANSWER, command=command)
    m = load_manifest(folder)
    before = len(upstream.calls)
    with pytest.raises(ManifestError, match=r"harness 'broken' cannot start: .*harness.toml command: " + why):
        run(specs_for(m, echo, 2), upstream, tmp_path, echo, backend="bwrap")
    assert len(upstream.calls) == before and not (tmp_path / "results.jsonl").exists()
    out = CliRunner().invoke(app, ["harness", "check", str(folder)])
    assert out.exit_code == 1 and "cannot start:" in out.output, out.output


@pytest.mark.sandbox
def test_commands_that_can_start_still_run(tmp_path: Path, upstream: Upstream, echo: EchoTaskSet) -> None:
    script = make_harness(tmp_path, "script", "#!/usr/bin/env python3\n" + ANSWER, command=["./main.py"])
    (script / "main.py").chmod(0o755)
    commands = {
        "options": ["python3", "-u", "-X", "utf8", "-W", "ignore", "main.py"],
        "inline": ["python3", "-c", ANSWER],
        "absolute": ["/usr/bin/env", "python3", "main.py"],
    }
    manifests = [load_manifest(script)]
    manifests += [load_manifest(make_harness(tmp_path, name, ANSWER, command=c)) for name, c in commands.items()]
    for m in manifests:
        (result,) = run(specs_for(m, echo, 1), upstream, tmp_path, echo, backend="bwrap")
        assert (result.status, result.reward) == ("succeeded", 1.0), (m.command, result.stderr_tail)
        out = CliRunner().invoke(app, ["harness", "check", str(m.dir)])
        assert out.exit_code == 0 and "cannot start" not in out.output, out.output


def test_harness_check_names_a_close_task_set_for_a_misspelt_one(tmp_path: Path) -> None:
    folder = make_harness(tmp_path, "typo", ANSWER, task_sets=["gues"])
    out = CliRunner().invoke(app, ["harness", "check", str(folder)])
    assert "task set 'gues' is neither built in nor registered" in out.output and "did you mean 'guess'" in out.output
