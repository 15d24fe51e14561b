"""Harnesses that bring their own packages: requirements.txt -> `clawpipe harness install` -> .venv.

The test harness imports ``roman`` (a small pure-Python package from PyPI that the project does not depend
on) next to the project's ``openai`` SDK, calls the model once and writes the roman numeral of the reply's
length. It is installed with ``clawpipe harness install`` (from PyPI) and run in bwrap with ``clawpipe
rollout``, where its environment must be visible and read-only.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from clawpipe.capture import read_results
from clawpipe.cli import app
from clawpipe.errors import ConfigError, ManifestError
from tests.cli_harnesses.support import REPO
from tests.support.upstream import ScriptedUpstream, say

HARNESS_TOML = """
name = "roman-agent"
description = "calls the model once; answers with roman numerals (the roman package, its own)"
api = "openai"
command = [".venv/bin/python", "harness.py"]
task_sets = ["romanfix"]
timeout_s = 60
"""

HARNESS_PY = """
import json, os, sys
from pathlib import Path

import openai  # the project's SDK, seen after the harness's own packages
import roman  # the harness's own package (requirements.txt)

task = json.loads(Path(os.environ["CLAWPIPE_TASK"]).read_text())
client = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"])
reply = client.chat.completions.create(
    model=os.environ["CLAWPIPE_MODEL"], messages=[{"role": "user", "content": task["prompt"]}]
).choices[0].message.content
try:
    (Path(roman.__file__).parent / "written-by-the-harness").write_text("x")
    read_only = False
except OSError:
    read_only = True
out = Path(os.environ["CLAWPIPE_OUTPUT"])
out.mkdir(parents=True, exist_ok=True)
(out / "answer.json").write_text(json.dumps(
    {"answer": roman.toRoman(len(reply)), "roman": roman.__file__, "read_only": read_only, "prefix": sys.prefix}
))
"""


class RomanTask:
    """Reward 1 when the harness answered IX (len("All done.") == 9) with its own roman package."""

    name = "romanfix"

    def prepare(self, task: dict[str, Any], workdir: Path) -> None:
        return None

    def verify(self, task: dict[str, Any], workdir: Path) -> tuple[float, dict[str, Any]]:
        path = workdir / "out" / "answer.json"
        info = json.loads(path.read_text()) if path.is_file() else {}
        return float(info.get("answer") == "IX"), info


def make_harness(root: Path) -> Path:
    folder = root / "roman-agent"
    folder.mkdir(parents=True)
    (folder / "harness.toml").write_text(HARNESS_TOML)
    (folder / "harness.py").write_text(HARNESS_PY)
    (folder / "requirements.txt").write_text("roman==4.2\n")
    return folder


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


@pytest.mark.sandbox
@pytest.mark.slow
def test_harness_with_its_own_package_installs_and_runs_in_bwrap(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import clawpipe.tasks

    monkeypatch.setitem(clawpipe.tasks._REGISTRY, "romanfix", RomanTask())
    assert importlib.util.find_spec("roman") is None, "the project itself does not have the package"
    root = tmp_path / "harnesses"
    folder = make_harness(root)
    dirs = ("--harness-dir", str(root))

    # Before the install the manifest says what to run.
    listing = invoke("harness", "list", *dirs)
    assert "INVALID" in listing.output and "run `clawpipe harness install roman-agent`" in listing.output

    out = invoke("harness", "install", "roman-agent", *dirs)
    assert out.exit_code == 0, (out.output, out.exception)
    assert "roman-agent: built .venv up to date with requirements.txt" in out.output
    assert list((folder / ".venv").glob("lib/python3.*/site-packages/roman.py"))
    again = invoke("harness", "install", "roman-agent", *dirs)
    assert again.exit_code == 0 and "up to date" in again.output and "built" not in again.output
    check = invoke("harness", "check", "roman-agent", *dirs)
    assert "command (sandbox): /harness/.venv/bin/python /harness/harness.py" in check.output
    assert "packages: .venv up to date with requirements.txt" in check.output

    task = {"task_set": "romanfix", "task_id": "r1", "prompt": "Say something.", "data": {}, "max_turns": 1}
    (tmp_path / "tasks.json").write_text(json.dumps(task))
    results = tmp_path / "results.jsonl"
    with ScriptedUpstream(default=say("All done."), model="tiny") as up:
        run = invoke(
            "rollout", "--harness", "roman-agent", *dirs, "--task-file", str(tmp_path / "tasks.json"),
            "--backend", "bwrap", "--proxy", up.url, "--model", "tiny", "--results", str(results),
        )  # fmt: skip
        calls = len(up.model_requests())
    assert run.exit_code == 0, (run.output, run.exception)
    [row] = [r for _, r, _ in read_results(results)]
    assert (row["status"], row["reward"], calls) == ("succeeded", 1.0, 1), row
    info = row["reward_info"] if isinstance(row["reward_info"], dict) else json.loads(row["reward_info"])
    assert info["roman"].startswith("/harness/.venv/lib/") and info["prefix"] == "/harness/.venv"
    assert info["read_only"] is True, "the harness's environment is read-only in the sandbox"

    # A changed requirements.txt makes the environment stale until the next install.
    (folder / "requirements.txt").write_text("roman==4.2\n# pinned\n")
    check = invoke("harness", "check", "roman-agent", *dirs)
    assert "packages: STALE (requirements.txt changed): run `clawpipe harness install roman-agent`" in check.output


def test_failed_install_leaves_no_environment(tmp_path: Path) -> None:
    """A requirement pip cannot satisfy: a clear error with pip's words, no half-built .venv."""
    folder = make_harness(tmp_path)
    (folder / "requirements.txt").write_text("./no-such-package-dir\n")
    out = invoke("harness", "install", "roman-agent", "--harness-dir", str(tmp_path))
    assert isinstance(out.exception, ConfigError), out.output
    assert "pip could not install" in str(out.exception) and "no-such-package-dir" in str(out.exception)
    assert not (folder / ".venv").exists()
    out = invoke("harness", "install", "nope", "--harness-dir", str(tmp_path))
    assert isinstance(out.exception, ManifestError) and "no harness 'nope'" in str(out.exception)
    (folder / "requirements.txt").unlink()
    out = invoke("harness", "install", "roman-agent", "--harness-dir", str(tmp_path))
    assert isinstance(out.exception, ConfigError) and "has no requirements.txt" in str(out.exception)


def test_harness_environments_are_ignored_by_git() -> None:
    proc = subprocess.run(["git", "check-ignore", "-q", "harnesses/any-harness/.venv/x"], cwd=REPO)
    assert proc.returncode == 0, "a harness's .venv is never committed"
