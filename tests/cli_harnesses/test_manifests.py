"""The real-CLI harness folders: manifests, launcher copies, pinned installs."""

from __future__ import annotations

import json
import subprocess
import time
import tomllib

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


@pytest.mark.parametrize("harness", HARNESSES)
def test_cli_config_names_a_pinned_installed_entry(harness: str, cli_installed: None) -> None:
    cli = tomllib.loads((REPO / "harnesses" / harness / "cli.toml").read_text())
    script = INSTALL_SCRIPT.read_text()
    assert f'"{cli["package"]}@{cli["version"]}"' in script, "cli.toml and the install script pin the same version"
    entry = NODE_DIR / "node_modules" / cli["entry"]
    assert entry.is_file()
    installed = json.loads((NODE_DIR / "node_modules" / cli["package"] / "package.json").read_text())["version"]
    assert installed == cli["version"]
    assert set(cli["modes"]) == {"full", "minimal"}
    assert "${prompt}" in cli["args"] and "${model}" in cli["args"]


def test_install_script_is_quick_when_installed(cli_installed: None) -> None:
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - t0 < 5
    assert proc.stderr == "", "nothing to do, nothing said"
