"""Adding a CLI by following harnesses/REAL_HARNESSES.md "Adding a CLI", with a throwaway CLI.

The CLI is tests/cli_harnesses/toy_cli/cli.js (a small Node agent: a config file whose models are keyed
by ``provider/model``, the model given as ``provider/model``, Chat Completions with one shell tool named
``do_it`` taking ``script``). The test writes its harness folder as the walkthrough says (cli.toml,
harness.toml, launch.py copied from another CLI), puts the package where the install would (a Node folder
of its own, named in the manifest), checks it with ``clawpipe harness check`` and runs it in bwrap with
``clawpipe rollout``, once in its default mode and once with ``--env CLAWPIPE_CLI_MODE=full``, against the
scripted upstream, which finds the tool by its schema.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from clawpipe.capture import read_results
from clawpipe.cli import app
from clawpipe.errors import ConfigError, ManifestError
from tests.cli_harnesses.support import REPO
from tests.support.upstream import ScriptedUpstream, find_shell_tool, shell_then_reply

TOY = Path(__file__).resolve().parent / "toy_cli" / "cli.js"
COMMAND = "echo toy > tool_ran.txt; echo marker-$((6*7))"

# Step 2 of the walkthrough: cli.toml. The model is passed as provider/model, and the config file keys its
# models table by that name (a templated key); apiKeyEnv names the variable, the key itself stays off disk.
CLI_TOML = """
package = "toy-cli"
version = "1.0.0"
entry = "toy-cli/cli.js"
args = ["run", "--config", "${home}/.toy/config.json", "--model", "clawpipe/${model}", "${mode_args}",
        "--", "${prompt}"]
stdout_file = "toy.json"

[files.".toy/config.json"]
providers = { clawpipe = { baseUrl = "${OPENAI_BASE_URL}", apiKeyEnv = "OPENAI_API_KEY" } }
models = { "clawpipe/${model}" = { maxTurns = 4, maxTokens = 256 } }

[modes.full]
args = []

[modes.minimal]
args = ["--brief"]
"""

# Step 3: harness.toml. The Node folder holding the package is mounted read-only at the same path.
HARNESS_TOML = """
name = "toy-cli"
description = "toy-cli 1.0.0 headless; Chat Completions."
api = "openai"
command = ["python3", "launch.py"]
task_sets = ["toyfix"]
timeout_s = 60

[resources]
memory_mb = 1024
cpus = 1.0
pids = 128

[env]
CLAWPIPE_CLI_MODE = "minimal"
CLAWPIPE_NODE_DIR = "{node_dir}"

[sandbox]
ro_paths = ["{node_dir}"]
"""


class ToolRan:
    """The throwaway task set: reward 1 when the CLI's shell tool wrote tool_ran.txt in the work dir."""

    name = "toyfix"

    def prepare(self, task: dict[str, Any], workdir: Path) -> None:
        (workdir / "README.txt").write_text("Create tool_ran.txt with the shell.\n")

    def verify(self, task: dict[str, Any], workdir: Path) -> tuple[float, dict[str, Any]]:
        f = workdir / "tool_ran.txt"
        ok = f.is_file() and f.read_text() == "toy\n"
        return float(ok), {"tool_ran": ok}


def add_toy_cli(root: Path) -> tuple[Path, Path]:
    """Follow the walkthrough into ``root``: the harness folder (with the kit beside it) and the Node folder."""
    harnesses = root / "harnesses"
    folder = harnesses / "toy-cli"
    folder.mkdir(parents=True)
    shutil.copytree(REPO / "harnesses" / "_kit", harnesses / "_kit")  # the shared launcher sits beside it
    node_dir = root / "node"
    package = node_dir / "node_modules" / "toy-cli"  # where `npm install --prefix <node dir>` puts it
    package.mkdir(parents=True)
    shutil.copy(TOY, package / "cli.js")
    (package / "package.json").write_text(json.dumps({"name": "toy-cli", "version": "1.0.0", "bin": "cli.js"}))
    (folder / "cli.toml").write_text(CLI_TOML)
    (folder / "harness.toml").write_text(HARNESS_TOML.replace("{node_dir}", str(node_dir)))
    launch = (REPO / "harnesses" / "codex" / "launch.py").read_text()  # step 4: copy a launch.py
    (folder / "launch.py").write_text(launch.replace("codex: runs Codex CLI", "toy-cli: runs toy-cli", 1))
    return harnesses, node_dir


def rollout(harnesses: Path, tmp: Path, url: str, name: str, *extra: str) -> dict[str, Any]:
    tasks = tmp / f"{name}.json"
    task = {
        "task_set": "toyfix",
        "task_id": name,
        "prompt": "Create tool_ran.txt, then say done.",
        "data": {},
        "max_turns": 4,
    }
    tasks.write_text(json.dumps(task))
    results = tmp / f"results-{name}.jsonl"
    args = ["rollout", "--harness", "toy-cli", "--harness-dir", str(harnesses), "--task-file", str(tasks)]
    args += ["--backend", "bwrap", "--proxy", url, "--model", "tiny", "--results", str(results), *extra]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, (out.output, out.exception)
    [row] = [row for _, row, _ in read_results(results)]
    return row


@pytest.mark.sandbox
@pytest.mark.slow
def test_a_cli_added_by_the_walkthrough_runs_in_bwrap(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import clawpipe.tasks

    monkeypatch.setitem(clawpipe.tasks._REGISTRY, "toyfix", ToolRan())
    harnesses, node_dir = add_toy_cli(tmp_path)
    check = CliRunner().invoke(app, ["harness", "check", "toy-cli", "--harness-dir", str(harnesses)])
    assert check.exit_code == 0, check.output
    assert f"ro_path {node_dir} (present)" in check.output

    with ScriptedUpstream(default=shell_then_reply(COMMAND), model="tiny") as up:
        minimal = rollout(harnesses, tmp_path, up.url, "minimal")
        n_minimal = len(up.model_requests())
        full = rollout(harnesses, tmp_path, up.url, "full", "--env", "CLAWPIPE_CLI_MODE=full")
        reqs = up.model_requests()
        answers = list(up.answers)
    for row in (minimal, full):
        assert (row["status"], row["reward"], row["n_calls"]) == ("succeeded", 1.0, 2), row
    assert n_minimal == 2 and len(reqs) == 4
    systems = [r.json()["messages"][0]["content"] for r in reqs]
    assert "(full mode)" not in systems[0] and "(full mode)" in systems[2], "--env chose the mode for that run"
    # The model argument reached the endpoint without its provider; the tool was found by its schema.
    assert {r.json()["model"] for r in reqs} == {"tiny"}
    assert [(a["kind"], a.get("name"), a.get("args")) for a in answers[:2]] == [
        ("tool", "do_it", {"script": COMMAND}),
        ("text", None, None),
    ]
    assert "marker-42" in json.dumps(reqs[1].json()["messages"][-1]), "the tool's output went back"


def test_env_option_rejects_what_it_cannot_set(tmp_path: Path) -> None:
    """`clawpipe rollout --env` takes KEY=VALUE, never a variable the runner sets itself."""
    harnesses, _ = add_toy_cli(tmp_path)
    base = ["rollout", "--harness", "toy-cli", "--harness-dir", str(harnesses), "--proxy", "http://127.0.0.1:9"]
    out = CliRunner().invoke(app, [*base, "--env", "CLAWPIPE_CLI_MODE"])
    assert isinstance(out.exception, ConfigError) and "expected KEY=VALUE" in str(out.exception)
    out = CliRunner().invoke(app, [*base, "--env", "HOME=/root"])
    assert isinstance(out.exception, ManifestError) and "may not set HOME" in str(out.exception)


def test_launcher_templates_keys_merges_mode_files_and_checks_env_values() -> None:
    """The launcher pieces a new CLI relies on: ${...} in table keys, "$$" for a literal "$" (a config's
    own ${VAR} reference), a mode's table deep-merged into the same file, [env_values] checked."""
    sys.path.insert(0, str(REPO / "harnesses" / "_kit"))
    try:
        import cli_launcher
    finally:
        sys.path.pop(0)
    values = {"model": "tiny", "OPENAI_BASE_URL": "http://h/v1"}
    table = {"models": {"p/${model}": {"url": "${OPENAI_BASE_URL}", "key": "$${KEY}"}}}
    assert cli_launcher.expand(table, values) == {"models": {"p/tiny": {"url": "http://h/v1", "key": "${KEY}"}}}
    base = {"tools": {"allow": ["a"], "search": True}, "update": False}
    assert cli_launcher.merge(base, {"tools": {"allow": ["b"]}}) == {
        "tools": {"allow": ["b"], "search": True},
        "update": False,
    }
    cli_launcher.check_env_values({"API": ["chat", "messages"]}, {"API": "chat"})
    with pytest.raises(SystemExit):
        cli_launcher.check_env_values({"API": ["chat", "messages"]}, {"API": "bogus"})


def test_shell_tool_found_by_schema_alone() -> None:
    """The scripted upstream calls any CLI's shell: a required string (or argv list) command argument, the
    tool speaking of a shell preferred; names play no part."""

    def fn(name: str, desc: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
        schema = {"type": "object", "properties": props, "required": required}
        return {"type": "function", "function": {"name": name, "description": desc, "parameters": schema}}

    s = {"type": "string"}
    tools = [
        fn("grep", "Search files", {"pattern": s, "command": s}, ["pattern"]),  # command not required
        fn("lookup", "Look up a command's manual", {"command": s, "section": s}, ["command", "section"]),
        fn("x1", "Runs a line in bash", {"script": s}, ["script"]),
    ]
    found = find_shell_tool(tools)
    assert found is not None and (found.name, found.key, found.argv) == ("x1", "script", False)
    argv_tool = {
        "name": "y",
        "input_schema": {"properties": {"cmd": {"type": "array", "items": s}}, "required": ["cmd"]},
    }
    found = find_shell_tool([{"type": "web_search"}, argv_tool])  # Messages-style schema, hosted tool skipped
    assert found is not None and (found.name, found.key, found.argv) == ("y", "cmd", True)
    assert find_shell_tool([fn("read", "Read a file", {"path": s}, ["path"])]) is None
