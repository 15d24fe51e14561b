"""The real-CLI harness folders: manifests, launcher copies, pinned installs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import tomllib
from pathlib import Path

import pytest

from tests.cli_harnesses.support import HARNESSES, INSTALL_SCRIPT, NODE_DIR, REPO

RESERVED = {"OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "HOME", "PATH"}


def test_launchers_are_thin_entries_to_the_shared_launcher() -> None:
    """Each CLI folder's launch.py only puts the kit on sys.path and runs harnesses/_kit/cli_launcher.py on
    its own folder; the launcher itself exists once."""
    kit = REPO / "harnesses" / "_kit"
    assert (kit / "cli_launcher.py").is_file() and not (kit / "harness.toml").exists()
    codes = set()
    for h in HARNESSES:
        text = (REPO / "harnesses" / h / "launch.py").read_text()
        code = text.split('"""', 2)[2]
        assert 'os.environ.get("CLAWPIPE_HARNESS_KIT")' in code and "cli_launcher.main(HERE)" in code
        assert len(code.strip().splitlines()) <= 10, "the launcher lives in harnesses/_kit/cli_launcher.py"
        codes.add(code)
    assert len(codes) == 1, "the entries differ only in their docstring"


@pytest.mark.parametrize("harness", HARNESSES)
def test_manifest_follows_the_contract(harness: str) -> None:
    folder = REPO / "harnesses" / harness
    manifest = tomllib.loads((folder / "harness.toml").read_text())
    assert manifest["name"] == harness
    assert manifest["api"] in ("openai", "anthropic")
    assert manifest["command"] == ["python3", "launch.py"]
    assert manifest["timeout_s"] > 0
    assert "fixit" in manifest["task_sets"]
    assert set(manifest["resources"]) == {"memory_mb", "cpus", "pids"}
    assert not RESERVED & set(manifest["env"]), "the runner sets these itself"
    assert all(isinstance(v, str) for v in manifest["env"].values())
    assert manifest["env"]["CLAWPIPE_CLI_MODE"] == "minimal", "CPU default; full is documented for GPU runs"
    assert isinstance(manifest["training"]["exclude_side_calls"], bool)
    assert manifest["sandbox"]["ro_paths"] == [".node"]


def cli_prefix(cli: dict) -> Path:
    """Where the install script puts a CLI: .node, or .node/node-<version> beside the Node it pins."""
    return NODE_DIR / f"node-{cli['node']}" if "node" in cli else NODE_DIR


@pytest.mark.parametrize("harness", HARNESSES)
def test_cli_config_names_a_pinned_installed_entry(harness: str, cli_installed: None) -> None:
    """cli.toml pins the package (the install script reads the pins from there) and the install matches it;
    the model may be passed inside a larger argument (OpenClaw takes ``provider/model``)."""
    cli = tomllib.loads((REPO / "harnesses" / harness / "cli.toml").read_text())
    prefix = cli_prefix(cli)
    entry = prefix / "node_modules" / cli["entry"]
    assert entry.is_file()
    installed = json.loads((prefix / "node_modules" / cli["package"] / "package.json").read_text())["version"]
    assert installed == cli["version"]
    assert set(cli["modes"]) == {"full", "minimal"}
    assert "${prompt}" in cli["args"], "the prompt is one argument of its own"
    assert any("${model}" in arg for arg in cli["args"]), "the served model name reaches the CLI"


@pytest.mark.parametrize("harness", HARNESSES)
def test_each_cli_has_the_node_it_needs(harness: str, cli_installed: None) -> None:
    """A CLI pinned to a Node version has exactly that Node beside it, inside the range its package's
    engines field asks for (OpenClaw: 24.22.3 for ">=24.16.0 <25 || ..."); the others run on the system
    Node, 20 or newer (Claude Code and Qwen Code ask for >= 22 but run on 20: their tests pass on it)."""
    cli = tomllib.loads((REPO / "harnesses" / harness / "cli.toml").read_text())
    if "node" in cli:
        [node] = (cli_prefix(cli) / "node_modules").glob("node-linux-*/bin/node")
    else:
        node = Path("/usr/bin/node")
    version = subprocess.run([str(node), "--version"], capture_output=True, text=True, check=True).stdout.strip()
    assert version == f"v{cli['node']}" if "node" in cli else int(version[1:].split(".")[0]) >= 20
    if "node" in cli:
        package = json.loads((cli_prefix(cli) / "node_modules" / cli["package"] / "package.json").read_text())
        lower, upper = package["engines"]["node"].split("||")[0].split()  # ">=24.16.0", "<25"
        have = tuple(int(x) for x in version[1:].split("."))
        assert have >= tuple(int(x) for x in lower[2:].split(".")) and have[0] < int(upper[1:]), (lower, upper)


def test_install_script_names_a_broken_cli_toml(tmp_path: Path) -> None:
    """The pins come from harnesses/*/cli.toml: one without a version stops the install with the file named."""
    (tmp_path / "broken-cli").mkdir()
    (tmp_path / "broken-cli" / "cli.toml").write_text('package = "some-cli"\nentry = "some-cli/cli.js"\n')
    env = {**os.environ, "CLAWPIPE_HARNESSES_DIR": str(tmp_path), "CLAWPIPE_NODE_DIR": str(tmp_path / "node")}
    proc = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 1
    assert f"{tmp_path}/broken-cli/cli.toml: needs TOML with package, version and entry" in proc.stderr
    assert not (tmp_path / "node").exists(), "nothing installed"


def test_install_script_is_quick_when_installed(cli_installed: None) -> None:
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - t0 < 5
    assert proc.stderr == "", "nothing to do, nothing said"


def test_the_mix_configs_shown_are_valid_and_the_cpu_one_is_what_the_test_runs() -> None:
    """harnesses/REAL_HARNESSES.md's pipeline configs load and pass the run's prerequisite check (every
    harness plays its task set), and one of them is the config test_mix_pipeline.py runs."""
    from clawpipe.pipeline.config import PipelineConfig
    from clawpipe.pipeline.stages import check_prerequisites
    from tests.cli_harnesses.test_mix_pipeline import CONFIG

    text = (REPO / "harnesses" / "REAL_HARNESSES.md").read_text()
    shown = [tomllib.loads(block) for block in re.findall(r"```toml\n(.*?)```", text, re.S) if "[[harnesses]]" in block]
    assert len(shown) == 2
    assert tomllib.loads(CONFIG) in shown
    for values in shown:
        cfg = PipelineConfig.model_validate(values)
        check_prerequisites(cfg)
        assert {h.name for h in cfg.harnesses} == {*HARNESSES, "chat-loop"}
