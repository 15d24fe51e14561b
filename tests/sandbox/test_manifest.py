"""Manifests and task files: valid ones load, malformed ones fail with a message naming the problem."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from clawpipe.errors import ManifestError
from clawpipe.sandbox import find_harness, list_harnesses, load_manifest, load_task_file, validate_task

GOOD = """
name = "demo"
description = "a demo"
api = "anthropic"
command = ["python3", "main.py", "--flag"]
task_sets = ["echo"]
timeout_s = 12
[resources]
memory_mb = 256
cpus = 0.5
pids = 32
[env]
SOME_VAR = "x"
[training]
exclude_side_calls = true
"""


def write(tmp_path: Path, text: str, name: str = "demo") -> Path:
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "main.py").write_text("print(1)\n")
    (d / "harness.toml").write_text(text)
    return d


def test_good_manifest_loads_every_field(tmp_path: Path) -> None:
    m = load_manifest(write(tmp_path, GOOD))
    assert (m.name, m.api, m.command, m.task_sets, m.timeout_s) == (
        "demo",
        "anthropic",
        ("python3", "main.py", "--flag"),
        ("echo",),
        12.0,
    )
    assert (m.limits.memory_mb, m.limits.cpus, m.limits.pids) == (256, 0.5, 32)
    assert m.env == {"SOME_VAR": "x"} and m.exclude_side_calls is True
    # relative script paths resolve against where the harness folder is visible; flags and programs do not
    assert m.resolve_command("/harness") == ["python3", "/harness/main.py", "--flag"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('name = "demo"\n', "missing required key `command`"),
        ('name = "demo"\ncommand = []\n', "non-empty list"),
        ('name = "demo"\ncommand = "python3 main.py"\n', "`command` must be a list"),
        ('name = "demo"\ncommand = ["x"]\napi = "gemini"\n', "`api` must be one of"),
        ('name = "demo"\ncommand = ["x"]\ncomand = 1\n', "unknown key(s) comand (did you mean command?)"),
        ('name = "demo"\ncommand = ["x"]\ntask_set = ["guess"]\n', "task_set (did you mean task_sets?)"),
        ('name = "demo"\ncommand = ["x"]\nzzz = 1\n', "unknown key(s) zzz; allowed: "),
        ('name = "other"\ncommand = ["x"]\n', "must equal its folder name"),
        ('name = "demo"\ncommand = ["x"]\ntimeout_s = -1\n', "`timeout_s` must be in"),
        ('name = "demo"\ncommand = ["x"]\n[resources]\nmemory_mb = "1G"\n', "resources.memory_mb"),
        ('name = "demo"\ncommand = ["x"]\n[resources]\ngpus = 1\n', "unknown [resources] key"),
        ('name = "demo"\ncommand = ["x"]\n[resources]\nmemory = 1\n', "memory (did you mean memory_mb?)"),
        ('name = "demo"\ncommand = ["x"]\n[env]\nOPENAI_BASE_URL = "http://evil"\n', "may not set OPENAI_BASE_URL"),
        ('name = "demo"\ncommand = ["x"]\n[env]\nN = 3\n', "N must be a string"),
        ('name = "demo"\ncommand = ["x"]\n[env]\nN = "a\\u0000b"\n', "N holds a NUL character"),
        ('name = "demo"\ncommand = ["x"]\ntask_sets = ["guess", "calc", "guess"]\n', "names guess more than once"),
        ('name = "demo"\ncommand = ["./missing.sh"]\n', "is not a file"),
        ('name = "demo"\ncommand = ["x"]\nfiles = ["nope.txt"]\n', "does not exist"),
        ('name = "demo"\ncommand = [\n', "not valid TOML"),
    ],
)
def test_malformed_manifest_names_the_problem(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ManifestError) as err:
        load_manifest(write(tmp_path, text))
    assert message in str(err.value)
    assert "harness.toml" in str(err.value)


def test_find_and_list_harnesses(tmp_path: Path) -> None:
    write(tmp_path, GOOD)
    assert find_harness("demo", [tmp_path]).name == "demo"
    assert [p.parent.name for p in list_harnesses([tmp_path])] == ["demo"]
    with pytest.raises(ManifestError, match=r"no harness named 'nope'.*known: \['demo'\]"):
        find_harness("nope", [tmp_path])


TASK = {"task_set": "echo", "task_id": "t1", "prompt": "p", "data": {}, "max_turns": 2}


def test_task_validation_and_files(tmp_path: Path) -> None:
    assert validate_task(dict(TASK)) == TASK
    with pytest.raises(ManifestError, match="missing `prompt`"):
        validate_task({k: v for k, v in TASK.items() if k != "prompt"})
    with pytest.raises(ManifestError, match="`max_turns` must be int"):
        validate_task({**TASK, "max_turns": "3"})
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text(json.dumps(TASK) + "\n" + json.dumps({**TASK, "task_id": "t2"}) + "\n")
    assert [t["task_id"] for t in load_task_file(jsonl)] == ["t1", "t2"]
    jsonl.write_text(json.dumps(TASK) + "\n{not json\n")
    with pytest.raises(ManifestError, match=r"tasks.jsonl:2: not valid JSON"):
        load_task_file(jsonl)
    arr = tmp_path / "tasks.json"
    arr.write_text(json.dumps([TASK, {**TASK, "data": []}]))
    with pytest.raises(ManifestError, match=r"tasks.json\[1\]: `data` must be dict"):
        load_task_file(arr)


def test_sandbox_ro_paths_resolve_against_the_repository_root(tmp_path: Path, home: Path) -> None:
    harnesses = tmp_path / "harnesses"
    harnesses.mkdir()
    write(harnesses, 'name = "demo"\ncommand = ["x"]\n[sandbox]\nro_paths = [".node", "' + str(tmp_path) + '/tools"]\n')
    m = load_manifest(harnesses / "demo")
    assert m.ro_paths == (tmp_path / ".node", tmp_path / "tools")
    write(harnesses, 'name = "demo"\ncommand = ["x"]\n[sandbox]\nro_paths = ["/"]\n')
    with pytest.raises(ManifestError, match="must name a specific folder"):
        load_manifest(harnesses / "demo")


def _ro(harnesses: Path, entry: str) -> Any:
    write(harnesses, f'name = "demo"\ncommand = ["x"]\n[sandbox]\nro_paths = ["{entry}"]\n')
    return load_manifest(harnesses / "demo")


def test_ro_paths_only_under_the_repository_or_the_operator_allow_list(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clawpipe import config

    harnesses = tmp_path / "harnesses"
    harnesses.mkdir()
    with pytest.raises(
        ManifestError, match=r"'/opt/tool' \(/opt/tool\) is outside the allowed roots \['" + str(tmp_path)
    ):
        _ro(harnesses, "/opt/tool")
    (tmp_path / "etc-link").symlink_to("/etc")  # under the repository, but bwrap would bind /etc
    with pytest.raises(ManifestError, match=r"'etc-link' \(/etc\) is outside the allowed roots"):
        _ro(harnesses, "etc-link")
    monkeypatch.setenv("CLAWPIPE_SANDBOX_RO_ROOTS", "/opt:/srv/tools")
    config.get_settings.cache_clear()
    assert _ro(harnesses, "/opt/tool").ro_paths == (Path("/opt/tool"),)
    assert _ro(harnesses, "/srv/tools/node").ro_paths == (Path("/srv/tools/node"),)
    with pytest.raises(ManifestError, match="CLAWPIPE_SANDBOX_RO_ROOTS"):
        _ro(harnesses, "/usr/local")


@pytest.mark.parametrize("where", ["home", "inside", "parent", "grandparent"])
def test_ro_paths_never_expose_the_clawpipe_home(
    where: str, tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clawpipe import config

    monkeypatch.setenv("CLAWPIPE_SANDBOX_RO_ROOTS", "/")  # even an operator who allows everything
    config.get_settings.cache_clear()
    harnesses = tmp_path / "harnesses"
    harnesses.mkdir()
    entry = {"home": home, "inside": home / "captures", "parent": home.parent, "grandparent": home.parent.parent}
    with pytest.raises(ManifestError, match=r"would expose the clawpipe home .*not be the home, inside it, or one"):
        _ro(harnesses, str(entry[where]))
